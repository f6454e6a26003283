"""Summarize a torch profiler trace (Chrome JSON, as vLLM's ``profiler_config`` writes it from the worker)
into the few numbers that tell where an engine step's time goes, per profiled request:

- the window, and how much of it the GPU was busy (union of kernels, copies and memsets), per stream;
- device-to-host and host-to-device copies: count, bytes, time;
- CUDA runtime calls on the CPU (launches, async copies, event queries/syncs, stream waits): count, time;
- CPU threads: busy time (union of their top-level events) per thread;
- the CPU ops and Python-side ranges that took the most time;
- engine steps by kind (prefill, decode-only, empty) and the GPU kernels that took the most time, so two
  engines' traces can be diffed kernel by kernel (``kernel_diff``): what one engine adds to a decode step.

    python benchmarks/trace_summary.py TRACE.json[.gz] [--requests N]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics
from pathlib import Path


def _load(path: Path) -> list[dict]:
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    data = json.loads(raw)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(path: Path, requests: int = 1, top: int = 12, kernel_top: int = 60) -> dict:
    events = [e for e in _load(Path(path)) if e.get("ph") == "X" and "dur" in e]
    if not events:
        return {"error": f"no complete events in {path}"}
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    window = t1 - t0
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    per_stream: dict[str, list] = collections.defaultdict(list)
    for e in gpu:
        per_stream[str(e.get("args", {}).get("stream", e.get("tid")))].append((e["ts"], e["ts"] + e["dur"]))
    copies: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    for e in gpu:
        if e.get("cat") == "gpu_memcpy":
            c = copies[e["name"]]
            c[0] += 1
            c[1] += e["dur"]
            c[2] += int(e.get("args", {}).get("bytes", 0) or 0)
    runtime: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            r = runtime[e["name"]]
            r[0] += 1
            r[1] += e["dur"]
    threads: dict[str, list] = collections.defaultdict(list)
    ops: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function", "cuda_runtime"):
            threads[f"{e.get('pid')}/{e.get('tid')}"].append((e["ts"], e["ts"] + e["dur"]))
        if e.get("cat") in ("cpu_op", "user_annotation"):
            ops[e["name"]] += e["dur"]
    n = max(1, requests)
    ms = 1e-3 / n  # microseconds in the trace -> ms per request
    # vLLM's per-step annotation (execute_context_<reqs>(<tokens>)_generation_...): how many steps a request
    # cost, empty ones (execute_context_0(0)_generation_0(0): a step that only hands finished request ids
    # on) apart, and how long the engine sat between steps (window minus the steps' union)
    steps = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation") and e["name"].startswith("execute_context")]
    step_ivs = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    empty = [e for e in steps if e["name"].startswith("execute_context_0(0)_generation_0(0)")]
    decode = [e for e in steps if e["name"].startswith("execute_context_0(0)_generation_") and e not in empty]
    kernels: dict[str, float] = collections.defaultdict(float)
    for e in gpu:
        if e.get("cat") == "kernel":
            kernels[_kernel_name(e["name"])] += e["dur"]
    return {
        "trace": Path(path).name, "requests": requests, "window_ms_per_request": window * ms,
        "gpu_busy_fraction": _union([iv for ivs in per_stream.values() for iv in ivs]) / window if window else 0.0,
        "gpu_busy_ms_per_request_by_stream": {s: _union(ivs) * ms for s, ivs in sorted(per_stream.items())},
        "kernels_per_request": sum(1 for e in gpu if e.get("cat") == "kernel") / n,
        "copies": {k: {"count_per_request": v[0] / n, "ms_per_request": v[1] * ms, "bytes_per_request": v[2] / n}
                   for k, v in sorted(copies.items())},
        "cuda_runtime": {k: {"count_per_request": v[0] / n, "ms_per_request": v[1] * ms}
                         for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:top]},
        "cpu_threads_busy_ms_per_request": {t: _union(ivs) * ms for t, ivs in
                                            sorted(threads.items(), key=lambda kv: -_union(kv[1]))[:6]},
        "top_cpu_ops_ms_per_request": {k: v * ms for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:top]},
        "steps_per_request": len(step_ivs) / n,
        "empty_steps_per_request": len(empty) / n,
        "empty_step_ms_per_request": sum(e["dur"] for e in empty) * ms,
        "between_steps_ms_per_request": (window - _union(step_ivs)) * ms if step_ivs else None,
        "decode_steps_per_request": len(decode) / n,
        # how full the steps were: "execute_context_<requests>(<tokens>)" -> how many steps, their median ms (CPU)
        "step_sizes": {k: [len(v), statistics.median(v)] for k, v in sorted(_step_sizes(steps).items())},
        "decode_step_ms_median": statistics.median(e["dur"] for e in decode) * 1e-3 if decode else None,
        "kernel_ms_per_request": sum(kernels.values()) * ms,
        "top_kernels_ms_per_request": {k: v * ms for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:kernel_top]},
    }


def _step_sizes(steps: list[dict]) -> dict[str, list[float]]:
    """Durations (ms) of the engine's steps by their context part (``execute_context_4(4096)``: 4 requests,
    4,096 tokens), the part of vLLM's step annotation that says how full a prefill step was."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for e in steps:
        out[e["name"].split("_generation", 1)[0]].append(e["dur"] * 1e-3)
    return out


def _kernel_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list: one row per kernel function."""
    for cut in ("<", "("):
        name = name.split(cut, 1)[0]
    return name.removeprefix("void ").strip()[:90]


def kernel_diff(base: dict, other: dict, top: int = 15) -> str:
    """The kernels whose time per request differs most between two summaries (``other`` minus ``base``),
    with the totals: what one engine's step runs on the GPU that the other's does not."""
    a, b = base.get("top_kernels_ms_per_request", {}), other.get("top_kernels_ms_per_request", {})
    rows = sorted(set(a) | set(b), key=lambda k: -abs(b.get(k, 0.0) - a.get(k, 0.0)))[:top]
    lines = [f"{'kernel (ms per request)':<92}{'base':>10}{'other':>10}{'diff':>10}",
             f"{'all kernels':<92}{base.get('kernel_ms_per_request', 0):>10.3f}"
             f"{other.get('kernel_ms_per_request', 0):>10.3f}"
             f"{other.get('kernel_ms_per_request', 0) - base.get('kernel_ms_per_request', 0):>+10.3f}"]
    for k in rows:
        lines.append(f"{k:<92}{a.get(k, 0.0):>10.3f}{b.get(k, 0.0):>10.3f}{b.get(k, 0.0) - a.get(k, 0.0):>+10.3f}")
    return "\n".join(lines)


def compare(summaries: dict[str, dict]) -> str:
    """A side-by-side table of the headline numbers of several summaries (name -> summary)."""
    names = list(summaries)
    lines = [f"{'per request':<44}" + "".join(f"{n:>20}" for n in names)]

    def row(label: str, get) -> None:
        vals = []
        for n in names:
            try:
                vals.append(f"{get(summaries[n]):>20.3f}")
            except (KeyError, TypeError, ValueError):
                vals.append(f"{'-':>20}")
        lines.append(f"{label:<44}" + "".join(vals))

    row("window ms", lambda s: s["window_ms_per_request"])
    row("busiest CPU thread ms", lambda s: max(s["cpu_threads_busy_ms_per_request"].values()))
    row("engine steps", lambda s: s["steps_per_request"])
    row("empty steps", lambda s: s["empty_steps_per_request"])
    row("empty steps ms", lambda s: s["empty_step_ms_per_request"])
    row("between steps ms (engine outside a step)", lambda s: s["between_steps_ms_per_request"])
    row("decode steps", lambda s: s["decode_steps_per_request"])
    row("decode step ms (median, CPU)", lambda s: s["decode_step_ms_median"])
    row("GPU kernels ms", lambda s: s["kernel_ms_per_request"])
    row("GPU busy fraction", lambda s: s["gpu_busy_fraction"])
    row("kernels", lambda s: s["kernels_per_request"])
    keys = sorted({k for s in summaries.values() for k in s.get("copies", {})})
    for k in keys:
        row(f"{k[:30]} ms", lambda s, k=k: s["copies"][k]["ms_per_request"])
    keys = sorted({k for s in summaries.values() for k in s.get("cuda_runtime", {})})
    for k in keys:
        row(f"{k[:34]} ms", lambda s, k=k: s["cuda_runtime"][k]["ms_per_request"])
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", nargs="+")
    ap.add_argument("--requests", type=int, default=1)
    args = ap.parse_args()
    sums = {Path(t).name[:18]: summarize(Path(t), args.requests) for t in args.trace}
    print(json.dumps(sums, indent=1))
    print(compare(sums))
    names = list(sums)
    for other in names[1:]:
        print(f"\n{names[0]} -> {other}")
        print(kernel_diff(sums[names[0]], sums[other]))


if __name__ == "__main__":
    main()
