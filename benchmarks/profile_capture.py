"""Where one request's time goes: run one engine (a capture_overhead variant) at a fixed number of
requests in flight, under py-spy, and summarize the samples per process and thread.

    python benchmarks/profile_capture.py --variant capture --inflight 1 --out prof/   # needs py-spy on PATH
    python benchmarks/profile_capture.py --summarize prof/capture_1.txt                # re-read a profile

The workload and model flags are capture_overhead.py's (same defaults). The summary lists, per process and
thread, the share of samples in each top-level activity and in layertap's own frames; idle samples are
kept (``--idle``), so "waiting" shows where a process waits for another.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _site(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one name per function, whatever line it is on."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0].rstrip(')')})" if where else name


def summarize(path: Path, top: int = 12, inclusive_top: int = 40) -> str:
    """Per (process, thread): sample count, the most common innermost frames, and the functions with the
    largest inclusive share (a function counted once per sample it is anywhere on the stack of)."""
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    ours: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # once per sample
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        key = f"{procs[-1][:60] if procs else 'process ?'} | {thread[:40]}"
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        body = [f.split(" (")[0] for f in code]
        per_thread[key][" ; ".join(body[-2:]) or "-"] += int(n)
        for f in set(map(_site, code)):
            inclusive[key][f] += int(n)
        mine = [f for f in body if "Layertap" in f or "WorkerSide" in f or "Tap." in f or "capture_hook" in f]
        if mine:
            ours[key][mine[-1]] += int(n)
    out = []
    for key, c in sorted(per_thread.items(), key=lambda kv: -sum(kv[1].values())):
        total = sum(c.values())
        out.append(f"{key}: {total} samples")
        out += [f"    {v / total:6.1%}  {k[:150]}" for k, v in c.most_common(top)]
        if inclusive_top:  # where a thread's time goes, callers included: a diff of two variants reads off these
            out.append("    inclusive: " + "; ".join(f"{k[:70]} {v / total:.1%}"
                                                     for k, v in inclusive[key].most_common(inclusive_top)))
        if ours.get(key):
            out.append("    layertap frames: " + ", ".join(f"{k} {v / total:.1%}" for k, v in ours[key].most_common(6)))
    return "\n".join(out)


def main() -> None:
    import capture_overhead as co

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="capture", choices=list(co.VARIANTS))
    ap.add_argument("--inflight", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=12.0, help="py-spy sampling time")
    ap.add_argument("--out", default="prof")
    ap.add_argument("--summarize", default=None, help="only summarize this raw py-spy profile")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.summarize:
        print(summarize(Path(args.summarize)))
        return
    if args.child:  # the profiled process: one engine, requests until killed
        bench_args = co.parse_args(rest)
        model, data = co.build_model(bench_args), co.prompts(bench_args)
        runner = co.VARIANTS[args.variant](model, data, bench_args)
        runner.rate(args.inflight, data[: max(2 * args.inflight, 8)])
        print("READY", flush=True)
        while True:
            print(f"rate {runner.rate(args.inflight):.0f} tok/s", flush=True)
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not on PATH (pip install py-spy)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"{args.variant}_{args.inflight}"
    log = open(out / f"{name}.log", "w")
    child = subprocess.Popen([sys.executable, __file__, "--child", "--variant", args.variant, "--inflight",
                              str(args.inflight), *rest], stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)  # its engine processes share its process group
    try:
        deadline = time.monotonic() + 900
        while "READY" not in (out / f"{name}.log").read_text():
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the engine did not start; see {out / f'{name}.log'}")
            time.sleep(1)
        time.sleep(3)
        raw = out / f"{name}.txt"
        subprocess.run([spy, "record", "-p", str(child.pid), "--subprocesses", "--idle", "--threads", "-r", "100",
                        "-d", str(int(args.seconds)), "-f", "raw", "-o", str(raw)], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)  # the child and the engine processes it started
        except ProcessLookupError:
            pass
        child.wait()
    rates = [ln for ln in (out / f"{name}.log").read_text().splitlines() if ln.startswith("rate ")]
    summary = f"{args.variant}, {args.inflight} in flight; rates (the first ones unprofiled): {rates[:6]}\n" + summarize(raw)
    (out / f"{name}.summary.txt").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
