"""Where one request's time goes: run one engine (a capture_overhead variant) at a fixed number of
requests in flight, under py-spy, and summarize the samples per process and thread.

    python benchmarks/profile_capture.py --variant capture --inflight 1 --out prof/   # needs py-spy on PATH
    python benchmarks/profile_capture.py --summarize prof/capture_1.txt                # re-read a profile
    python benchmarks/profile_capture.py --diff prof/plain_16.json prof/capture_16.json   # ms per request, A -> B

The workload and model flags are capture_overhead.py's (same defaults). The summary lists, per process and
thread, the share of samples in each top-level activity and in layertap's own frames; idle samples are
kept (``--idle``), so "waiting" shows where a process waits for another.

Beside each raw profile, ``<variant>_<inflight>.json`` keeps every thread's inclusive sample counts by
function and the request rate while it ran; ``--diff A B`` turns two of them into milliseconds per request
(a function's share of a thread's samples times the thread's wall time per request) and prints, for each
thread both runs have (matched by process and thread name, not pid), the functions whose time per request
differs most: where one variant's extra time per request goes, waiting included.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import statistics
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


def _role(proc: str, thread: str) -> str:
    """A thread's name across runs: its process's title and its own name, without pids or thread ids."""
    proc = re.sub(r"^process \d+:", "", proc).strip('"').split(" --")[0][:60]
    name = re.sub(r"^thread \(\w+\):? ?", "", thread)[:40]
    return f"{proc} | {name}"


def _samples(path: Path):
    """(process frame, thread frame, code frames, samples) per line of a raw py-spy profile."""
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        yield (procs[-1] if procs else "process ?", thread,
               [f for f in frames if not f.startswith(("process ", "thread "))], int(n))


def counts(path: Path) -> dict[str, dict]:
    """Per thread (``_role``): its samples and each function's inclusive sample count (once per sample)."""
    out: dict[str, dict] = {}
    for proc, thread, code, n in _samples(path):
        t = out.setdefault(_role(proc, thread), {"samples": 0, "inclusive": {}})
        t["samples"] += n
        for f in set(map(_site, code)):
            t["inclusive"][f] = t["inclusive"].get(f, 0) + n
    return out


def requests_per_s(rates: list[float], prompt_len: int) -> float:
    """Requests a second while py-spy ran: the median of the rate lines after the first three (those ran
    before it attached), in tokens/s, over the prompt length."""
    body = rates[3:] if len(rates) > 4 else rates
    if not body or prompt_len <= 0:
        raise ValueError("no request rate to turn samples into time per request")
    return statistics.median(body) / prompt_len


def diff(a: dict, b: dict, top: int = 15, min_ms: float = 0.05) -> str:
    """Two profiles' sidecars (``counts`` + rate): per thread both have, the functions whose inclusive time
    per request differs most, B minus A, in ms."""
    lines = [f"{a['variant']} -> {b['variant']} at {b['inflight']} in flight: ms per request (inclusive; a thread's "
             f"wall time per request is 1000 / requests per s: {1e3 / a['requests_per_s']:.2f} -> "
             f"{1e3 / b['requests_per_s']:.2f})"]
    for role in sorted(set(a["threads"]) & set(b["threads"])):
        ms = []
        for side in (a, b):
            t = side["threads"][role]
            wall = 1e3 / side["requests_per_s"]
            ms.append({f: wall * n / t["samples"] for f, n in t["inclusive"].items()} if t["samples"] else {})
        # Frames on (nearly) every sample of the thread in both runs (its entry point, the loop it lives in)
        # change only with the wall time per request; frames on every sample of one run and absent from the
        # other are how each was started (a forked engine core against a spawned one, the driver's own loop).
        # Both are left out: the rows say where the time moved.
        def root(f: str, side: dict) -> bool:
            t = side["threads"][role]
            return t["inclusive"].get(f, 0) == 0 or t["inclusive"][f] >= 0.99 * t["samples"]

        every = {f for f in set(ms[0]) | set(ms[1]) if root(f, a) and root(f, b)}
        rows = sorted((set(ms[0]) | set(ms[1])) - every, key=lambda f: -abs(ms[1].get(f, 0.0) - ms[0].get(f, 0.0)))
        rows = [f for f in rows[:top] if abs(ms[1].get(f, 0.0) - ms[0].get(f, 0.0)) >= min_ms]
        if rows:
            lines.append(f"{role}")
            lines += [f"    {ms[0].get(f, 0.0):8.3f} {ms[1].get(f, 0.0):8.3f} {ms[1].get(f, 0.0) - ms[0].get(f, 0.0):+8.3f}  {f[:110]}"
                      for f in rows]
    return "\n".join(lines)


def summarize(path: Path, top: int = 12, inclusive_top: int = 40) -> str:
    """Per (process, thread): sample count, the most common innermost frames, and the functions with the
    largest inclusive share (a function counted once per sample it is anywhere on the stack of)."""
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    ours: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # once per sample
    for proc, thread, code, n in _samples(path):
        key = f"{proc[:60]} | {thread[:40]}"
        body = [f.split(" (")[0] for f in code]
        per_thread[key][" ; ".join(body[-2:]) or "-"] += n
        for f in set(map(_site, code)):
            inclusive[key][f] += n
        mine = [f for f in body if "Layertap" in f or "WorkerSide" in f or "Tap." in f or "capture_hook" in f]
        if mine:
            ours[key][mine[-1]] += n
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
    ap.add_argument("--diff", nargs=2, default=None, metavar=("A", "B"),
                    help="two profiles' .json sidecars: ms per request by function, B minus A")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.summarize:
        print(summarize(Path(args.summarize)))
        return
    if args.diff:
        print(diff(*(json.loads(Path(p).read_text()) for p in args.diff)))
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
        for seg in Path("/dev/shm").glob(f"layertap-{child.pid}-*"):  # its transport pool: killed, not closed
            seg.unlink(missing_ok=True)
    rates = [ln for ln in (out / f"{name}.log").read_text().splitlines() if ln.startswith("rate ")]
    bench_args = co.parse_args(rest)
    try:
        rps = requests_per_s([float(ln.split()[1]) for ln in rates], bench_args.prompt_len)
    except ValueError:
        rps = float("nan")
    (out / f"{name}.json").write_text(json.dumps({"variant": args.variant, "inflight": args.inflight,
                                                  "requests_per_s": rps, "rates": rates, "threads": counts(raw)}))
    summary = f"{args.variant}, {args.inflight} in flight; rates (the first ones unprofiled): {rates[:6]}\n" + summarize(raw)
    (out / f"{name}.summary.txt").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
