"""Does another process's device-to-host copying slow this process's host work? (GPU only)

    python benchmarks/dma_host_interference.py [--mb 16] [--ring-mb 1024] [--rounds 30]

Capture's record copies land in host memory by DMA (the record process, its own CUDA context, copying
records of ~16 MiB each into the registered shared-memory pool), while vLLM's step thread runs Python
that is bound by the CPU at 1-16 requests in flight. The step profile of 2026-12-07 put that thread's
functions 7-15% slower with capture than without, in functions that do no record work (read per run later,
most of that was the host's own drift: ``step_profile.py``'s pace line). One explanation to rule out either
way: the DMA traffic itself (memory bandwidth, or inbound writes placed in the last-level cache, as on hosts
with Intel DDIO) slowing unrelated host code.

A child process (spawned; blocking event waits, as the record process) copies ``--mb`` MiB from the device
into successive places of a ``--ring-mb`` page-locked ring, either back to back (``busy``, the copy engine's
full rate) or one copy every ``--gap-ms`` (``paced``, about the rate capture writes at 4-16 in flight). The
parent measures three kinds of host work in windows that alternate with the child copying and idle, in
the same run, so drift hits both alike:

- ``python``: dict and list churn (the scheduler's and the model runner's bookkeeping);
- ``numpy copy``: 32 MiB copied in memory (bandwidth-bound host code);
- ``launches``: 200 small kernels launched on this process's own stream, then a sync (the step thread's
  launches).

Each is timed with the child on a CPU far from the parent's and on the parent's hyperthread sibling (where the
host has one). Printed: median time with the copies over median time idle, per work, mode and placement
(1.00: no effect).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path


def _siblings(cpu: int) -> list[int]:
    p = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    if not p.exists():
        return [cpu]
    out: list[int] = []
    for part in p.read_text().strip().split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _copier(mb: int, ring_mb: int, cpu: int, on, mode, gap_ms: float, ready, stop) -> None:
    import torch

    os.sched_setaffinity(0, {cpu})
    n = mb << 20
    slots = max(1, ring_mb // mb)
    src = torch.zeros(n, dtype=torch.uint8, device="cuda")
    ring = torch.empty(slots * n, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    done = torch.cuda.Event(blocking=True)
    i = 0
    ready.set()
    while not stop.is_set():
        if not on.value:
            time.sleep(0.001)
            continue
        with torch.cuda.stream(stream):
            ring[i * n:(i + 1) * n].copy_(src, non_blocking=True)
            done.record(stream)
        done.synchronize()
        i = (i + 1) % slots
        if mode.value == 1:  # paced
            time.sleep(gap_ms / 1e3)


def _python_work(reps: int = 20000) -> None:
    d: dict[str, list[int]] = {}
    for i in range(reps):
        k = f"req-{i % 257}"
        v = d.setdefault(k, [])
        v.append(i)
        if len(v) > 8:
            d[k] = sorted(v)[-4:]
    sum(len(v) for v in d.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=16, help="one copy (a 1,024-token record of 4 x 2048 bf16 rows is 16 MiB)")
    ap.add_argument("--ring-mb", type=int, default=1024, help="host ring the copies cycle through (the pool's size)")
    ap.add_argument("--gap-ms", type=float, default=4.0, help="pause after each copy in the paced mode (16 MiB every ~4.3 ms: ~3.9 GB/s)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--samples", type=int, default=3, help="timed runs of each work per window")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("dma_host_interference needs a CUDA device")
    import multiprocessing as mp

    cpus = sorted(os.sched_getaffinity(0))
    me = cpus[len(cpus) // 2]  # not CPU 0, where interrupts tend to land
    os.sched_setaffinity(0, {me})
    sib = [c for c in _siblings(me) if c != me and c in cpus]
    far = [c for c in cpus if c not in _siblings(me)]
    placements = {"far CPU": far[-1]} if far else {}  # far holds neither this CPU nor its siblings
    if sib:
        placements["hyperthread sibling"] = sib[0]
    x = torch.zeros(1024, device="cuda")
    big = torch.empty(32 << 20, dtype=torch.uint8).numpy()
    big2 = big.copy()

    def launches() -> None:
        for _ in range(200):
            x.add_(1.0)
        torch.cuda.synchronize()

    works = {"python": _python_work, "numpy copy": lambda: big2.__setitem__(slice(None), big), "launches": launches}
    for w in works.values():  # warm-up
        w()
    ctx = mp.get_context("spawn")
    print(f"host work beside another process's device-to-host copies ({args.mb} MiB each into a {args.ring_mb} MiB "
          f"page-locked ring), {torch.cuda.get_device_name()}, parent on CPU {me}; {args.rounds} rounds, "
          f"median time with copies / idle [min-max of the rounds' ratios]")
    for pname, cpu in placements.items():
        on, mode = ctx.Value("i", 0), ctx.Value("i", 0)
        ready, stop = ctx.Event(), ctx.Event()
        p = ctx.Process(target=_copier, args=(args.mb, args.ring_mb, cpu, on, mode, args.gap_ms, ready, stop),
                        daemon=True)
        p.start()
        try:
            if not ready.wait(120):
                raise SystemExit("the copying process did not start within 120 s")
            for mname, m in (("busy", 0), ("paced", 1)):
                mode.value = m
                ratios: dict[str, list[float]] = {k: [] for k in works}
                for _ in range(args.rounds):
                    got: dict[tuple[str, int], list[float]] = {}
                    for state in (1, 0):
                        on.value = state
                        time.sleep(0.05)  # the copies start (or the last one lands)
                        for k, w in works.items():
                            ts = []
                            for _ in range(args.samples):
                                t0 = time.perf_counter()
                                w()
                                ts.append(time.perf_counter() - t0)
                            got[(k, state)] = ts
                    for k in works:
                        ratios[k].append(statistics.median(got[(k, 1)]) / statistics.median(got[(k, 0)]))
                on.value = 0
                for k, r in ratios.items():
                    print(f"  child on {pname} (CPU {cpu}), {mname:<5} {k:<11} {statistics.median(r):5.2f} "
                          f"[{min(r):.2f}-{max(r):.2f}]", flush=True)
        finally:
            stop.set()
            p.join(10)
            if p.is_alive():
                p.kill()


if __name__ == "__main__":
    main()
