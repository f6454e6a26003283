"""Where an engine's time per request goes, function by function, in each variant of capture_overhead.py:
deterministic wall-time counters (``step_timer/sitecustomize.py``) around vLLM's and layertap's per-step
functions in every engine process, read after a warm-up and after the measured requests.

    python benchmarks/step_profile.py --variants plain-spawn,floor,capture --inflight 1 --repeats 3 \
        --prompts 64 --prompt-len 256            # model and workload flags are capture_overhead.py's

All variants' engines are alive at once in one child process (as capture_overhead.py pairs them); in each of
``--repeats`` rounds and for each ``--inflight`` target, every variant in turn (the order rotates) runs all the
prompts, between two dumps of its own engine processes' counters. Prints tokens/s per variant (median over repeats) and, per
function, microseconds per request (median over repeats; inclusive: a caller's time holds its callees'),
sorted by the largest difference against the first variant. Unlike sampling (py-spy), the counters do not
slow the engine unevenly: every variant pays the same two clock reads per wrapped call. ``--json`` keeps it all.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(p.name))
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        for c in kids.get(q, []):
            out.append(c)
            todo.append(c)
    return out


def child(variants: list[str], inflights: list[int], repeats: int, rest: list[str], result: Path) -> None:
    """All variants' engines alive at once (as capture_overhead.py pairs them); per round, per in-flight
    target, each variant in turn (the order rotates) runs every prompt between two dumps of its own processes."""
    import capture_overhead as co

    args = co.parse_args(rest + ["--batch-sizes", ",".join(map(str, inflights))])
    if torch_cuda():  # every engine alive at once: share the GPU as capture_overhead.py's paired mode does
        args.gpu_mem = min(args.gpu_mem or 0.35, 0.8 / len(variants))
    model, data = co.build_model(args), co.prompts(args)
    sig = signal.SIGRTMIN + 3
    runners, pids = {}, {}
    try:
        for v in variants:
            before = set(descendants(os.getpid()))
            runners[v] = co.VARIANTS[v](model, data, args)
            pids[v] = sorted(set(descendants(os.getpid())) - before)
            for k in inflights:
                runners[v].rate(k, data[: max(4 * k, 16)])
        runs = []
        dumps: dict[int, int] = {}  # dumps asked of each process so far (its files are <pid>.<n>.json)
        for r in range(repeats):
            for j, k in enumerate(inflights):
                o = (r + j) % len(variants)
                for v in variants[o:] + variants[:o]:
                    who = [*pids[v], os.getpid()]  # the variant's engine processes, and this driver
                    at = {pid: dumps.get(pid, 0) for pid in who}
                    signal_pids(who, sig)
                    time.sleep(0.3)  # every process writes its dump
                    t0 = time.perf_counter()
                    rate = runners[v].rate(k)
                    wall = time.perf_counter() - t0
                    signal_pids(who, sig)
                    time.sleep(0.3)
                    for pid in who:
                        dumps[pid] = at[pid] + 2
                    runs.append({"variant": v, "inflight": k, "round": r, "rate": rate, "wall": wall,
                                 "requests": len(data), "dumps": at})
                    print(f"round {r} {k} in flight {v}: {rate:.0f} tok/s", flush=True)
    finally:
        for x in runners.values():
            x.close()
    result.write_text(json.dumps({"runs": runs, "pids": pids}))


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def read_dumps(folder: Path, at: dict[str, int]) -> dict[str, dict[str, list]]:
    """Per process of a run (its title + pid), the difference of its dumps n+1 and n (``at``: pid -> n)."""
    out = {}
    for pid, n in at.items():
        fa, fb = folder / f"{pid}.{n}.json", folder / f"{pid}.{n + 1}.json"
        if not (fa.exists() and fb.exists()):
            continue
        da, db = json.loads(fa.read_text()), json.loads(fb.read_text())
        a, b = da["stats"], db["stats"]
        diff = {k: [v[0] - a.get(k, [0, 0.0])[0], v[1] - a.get(k, [0, 0.0])[1]] for k, v in b.items()}
        diff = {k: v for k, v in diff.items() if v[0] > 0}
        if diff:
            out[f"{da['title'].rsplit('/', 1)[-1][:24]}:{pid}"] = diff
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["plain-spawn", "floor", "capture"])
    ap.add_argument("--inflight", type=lambda s: [int(x) for x in s.split(",")], default=[1])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/layertap-step-profile")
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", default=None, help="only print (and --plot) a saved --json result")
    ap.add_argument("--plot", default=None, help="also draw layertap's per-request engine work by part (PNG)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.report:
        res = json.loads(Path(args.report).read_text())
        variants = list(dict.fromkeys(r["variant"] for r in res["runs"]))
        inflights = list(dict.fromkeys(r["inflight"] for r in res["runs"]))
        show(res, variants, inflights, args.plot)
        return
    root = Path(args.dir)
    if args.child:
        child(args.variants, args.inflight, args.repeats, rest, root / "result.json")
        return
    root.mkdir(parents=True, exist_ok=True)
    for f in root.glob("*.json"):
        f.unlink()
    env = {**os.environ, "LAYERTAP_STEP_TIMER": str(root),
           "PYTHONPATH": os.pathsep.join([str(HERE / "step_timer"), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--child", "--variants", ",".join(args.variants), "--inflight",
           ",".join(map(str, args.inflight)), "--repeats", str(args.repeats), "--dir", str(root), *rest]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print("\n".join(ln for ln in p.stdout.splitlines() if ln.startswith("round ")))
    if p.returncode != 0:
        print(p.stdout[-6000:])
        raise SystemExit(f"the profiled run failed with exit {p.returncode}")
    res = json.loads((root / "result.json").read_text())
    for run in res["runs"]:
        run["procs"] = read_dumps(root, run["dumps"])
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    show(res, args.variants, args.inflight, args.plot)


def show(res: dict, variants: list[str], inflights: list[int], plot_path: str | None) -> None:
    """Every in-flight target's table, and the plot where one is asked for."""
    for k in inflights:
        report({v: [r for r in res["runs"] if r["variant"] == v and r["inflight"] == k] for v in variants}, k)
    if plot_path:
        plot(res, variants, inflights, Path(plot_path))


PARTS = {  # layertap's work on the engine's step thread, in parts that do not nest (counter names)
    "record path (get_finished)": (["connector:LayertapConnector.get_finished"], []),
    "vLLM's connector calls around\nevery step (pre/post_forward)": (
        ["kv_connector:ActiveKVConnector.pre_forward", "kv_connector:ActiveKVConnector.post_forward"],
        ["connector:LayertapConnector.get_finished"]),
    "scheduler side (build_meta)": (["saves:SchedulerSide.build_meta"], []),
    "request finished (vLLM + layertap)": (["scheduler:Scheduler._connector_finished"], []),
    "hook: rows into the capture layer": (["compat:KernelScatter.__call__", "cache_view:check_planes",
                                           "cache_view:scatter_planes"], []),
    "per-layer connector check": (["connector:LayertapConnector.has_connector_metadata"], []),
    "capture layer's attention metadata": (["extract_hidden_states:CacheOnlyAttentionMetadataBuilder.build"], []),
}


def totals(run: dict) -> dict[str, list]:
    """One run's counters summed over its processes (a function runs in one of them): name -> [calls, seconds]."""
    tot: dict[str, list] = {}
    for stats in run["procs"].values():
        for k, (n, sec) in stats.items():
            t = tot.setdefault(k, [0, 0.0])
            t[0] += n
            t[1] += sec
    return tot


def per_request(runs: list[dict]) -> tuple[dict[str, float], dict[str, float]]:
    """Medians over runs of microseconds and of calls per request, by counter (summed over the run's processes:
    a function runs in one of them)."""
    us: dict[str, list[float]] = {}
    calls: dict[str, list[float]] = {}
    for run in runs:
        for k, (n, sec) in totals(run).items():
            us.setdefault(k, []).append(1e6 * sec / run["requests"])
            calls.setdefault(k, []).append(n / run["requests"])
    return ({k: statistics.median(x) for k, x in us.items()}, {k: statistics.median(x) for k, x in calls.items()})


def plot(res: dict, variants: list[str], inflights: list[int], out: Path) -> None:
    """Per in-flight target, layertap's per-request work on the engine thread by part (PARTS), per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [v for v in variants if v != variants[0]]
    fig, axes = plt.subplots(1, len(inflights), figsize=(6.5 * len(inflights), 4.2), squeeze=False)
    for ax, k in zip(axes[0], inflights):
        y = range(len(PARTS))
        for i, v in enumerate(shown):
            per, _ = per_request([r for r in res["runs"] if r["variant"] == v and r["inflight"] == k])
            vals = [sum(per.get(a, 0.0) for a in add) - sum(per.get(b, 0.0) for b in sub)
                    for add, sub in PARTS.values()]
            h = 0.8 / len(shown)
            ax.barh([j + i * h for j in y], vals, height=h, label=f"{v} (sum {sum(vals):.0f} us)")
        ax.set_yticks([j + 0.4 - 0.4 / len(shown) for j in y], list(PARTS), fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("microseconds per request (median over runs)")
        ax.set_title(f"{k} in flight: layertap's work on the engine thread")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def report(runs: dict[str, list[dict]], inflight: int) -> None:
    variants = list(runs)
    print(f"\n{inflight} in flight; tokens/s (median of {len(next(iter(runs.values())))} runs): "
          + ", ".join(f"{v} {statistics.median(r['rate'] for r in runs[v]):.0f}" for v in variants))
    per, calls = {}, {}
    for v in variants:
        per[v], calls[v] = per_request(runs[v])
    names = sorted(set().union(*per.values()))
    base = variants[0]
    names.sort(key=lambda k: -max(abs(per[v].get(k, 0.0) - per[base].get(k, 0.0)) for v in variants))
    print("us per request (calls per request), inclusive, median over runs; sorted by the largest change from "
          + base)
    print(f"{'function':58}" + "".join(f"{v:>22}" for v in variants))
    for k in names:
        print(f"{k[:58]:58}" + "".join(f"{per[v].get(k, 0.0):>12.1f} ({calls[v].get(k, 0.0):>6.2f})" for v in variants))
    pace(runs)


def pace(runs: dict[str, list[dict]]) -> None:
    """Per run, the host's pace beside the throughput: ms a call of the engine's step and of the model's forward.
    Where these move between runs of one variant as much as the variants differ (an H100 host, 2026-12-07: the
    forward 12.8-18.5 ms a call within one variant, throughput following it), the medians of shared functions
    above show the host's drift; read only functions that exist in one variant."""
    print("per run (in run order): tokens/s / ms a call of the engine step / of the model's forward")
    for v, rs in runs.items():
        cells = []
        for r in rs:
            tot = totals(r)
            step = tot.get("core:EngineCore.step_with_batch_queue", [0, 0.0])
            fwd = next((t for k, t in tot.items() if k.endswith("ForCausalLM.forward")), [0, 0.0])
            ms = [1e3 * sec / n if n else float("nan") for n, sec in (step, fwd)]
            cells.append(f"{r['rate']:>8.0f} / {ms[0]:5.2f} / {ms[1]:5.2f}")
        print(f"  {v:<14}" + "   ".join(cells))


if __name__ == "__main__":
    main()
