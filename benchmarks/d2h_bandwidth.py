"""Device-to-host copy bandwidth into the kinds of host memory a record can land in (GPU only).

    python benchmarks/d2h_bandwidth.py [--mb 16] [--copies 64]

Baseline: page-locked memory from CUDA's allocator (``torch.empty(pin_memory=True)``). Compared with it:
a shared-memory mapping page-locked with ``cudaHostRegister`` (what the shm transport's pool is when the
worker copies rows straight into it), and ordinary pageable memory. Capture has to move
``tokens/s x layers x hidden x bytes`` through this copy; if the registered pool is much slower than the
baseline, the copy (not the engine) caps capture throughput at large batch sizes.

It then asks whether a record's copy holds up the engine's own small device-to-host copies (vLLM copies each
step's sampled token ids to the host on a stream of its own and waits for them before the step's output):
the time until an 8-byte copy on a second stream has landed, alone and queued just after one record-sized copy
on the first stream (into the registered mapping, as the worker does). If the small copy waits for the big
one, a record of N MiB delays the output of its step by its whole copy time; and whether it waits less when the
record is copied in 1 MiB pieces. Last, the same small copy and a matmul, alone and beside another process that
copies records to the host back to back (its own CUDA context, as layertap's record process).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # layertap, run from anywhere

from layertap.engine.record_proc import pieces  # noqa: E402  (how the record process splits a copy)


def rate(dst: torch.Tensor, src: torch.Tensor, copies: int, non_blocking: bool) -> float:
    """GB/s of ``copies`` back-to-back copies of src into dst."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=non_blocking)  # warm-up
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.copy_(src, non_blocking=non_blocking)
        stream.synchronize()
    return copies * src.numel() * src.element_size() / (time.perf_counter() - t0) / 1e9


def _until_landed(wait: torch.cuda.Stream, *copies: tuple[torch.cuda.Stream, torch.Tensor, torch.Tensor]) -> float:
    """Seconds from queueing ``copies`` (stream, dst, src; in this order, on an idle device) until ``wait``
    has run them; the device is idle again on return."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for stream, dst, src in copies:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
    wait.synchronize()
    dt = time.perf_counter() - t0
    torch.cuda.synchronize()
    return dt


HOL_REPS = 20


def head_of_line(dst: torch.Tensor, src: torch.Tensor) -> dict[str, float]:
    """Median microseconds until an 8-byte copy on its own stream has landed: alone, and queued right after
    the big ``src -> dst`` copy on another stream; and the big copy alone."""
    big_s, small_s = torch.cuda.Stream(), torch.cuda.Stream()
    big = (big_s, dst, src)
    tiny_host = torch.empty(8, dtype=torch.uint8, pin_memory=True)
    small = (small_s, tiny_host, torch.zeros(8, dtype=torch.uint8, device=src.device))
    # the same big copy in 1 MiB pieces, as the record process makes them (offload_copy_chunk_kb=1024)
    parts = [(big_s, dst[o:o + k], src[o:o + k]) for o, k in pieces(src.numel(), 1 << 20)]
    cases = {"small alone": (small_s, small), "big alone": (big_s, big), "small after big": (small_s, big, small),
             "small after big in pieces": (small_s, *parts, small)}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(HOL_REPS):
        for k, (wait, *copies) in cases.items():
            times[k].append(_until_landed(wait, *copies))
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def _copier(mb: int, piece: int, seconds: float, ready, go) -> None:
    """In another process (its own CUDA context, as layertap's record process): device-to-host copies of ``mb``
    MiB into page-locked memory, back to back, for ``seconds``; each one whole (``piece`` 0) or in pieces of
    ``piece`` bytes (the record process's ``offload_copy_chunk_kb``)."""
    n = mb << 20
    src = torch.zeros(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    spans = pieces(n, piece)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        dst.copy_(src, non_blocking=True)
    s.synchronize()
    ready.set()
    go.wait()
    end = time.perf_counter() + seconds
    with torch.cuda.stream(s):
        while time.perf_counter() < end:
            for o, k in spans:
                dst[o:o + k].copy_(src[o:o + k], non_blocking=True)
            s.synchronize()


def other_process(mb: int, reps: int = 200) -> dict[str, tuple[float, float]]:
    """Median and p90 microseconds of what a vLLM step waits for, with and without another process copying
    ``mb`` MiB records to the host back to back: an 8-byte device-to-host copy on its own stream (the
    sampled token ids), and a 4096 x 2048 x 2048 bf16 matmul (a slice of a forward step)."""
    import multiprocessing as mp

    small_s = torch.cuda.Stream()
    tiny_host = torch.empty(8, dtype=torch.uint8, pin_memory=True)
    tiny = torch.zeros(8, dtype=torch.uint8, device="cuda")
    a = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def sample() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {"small copy": [], "matmul": []}
        for _ in range(reps):
            out["small copy"].append(_until_landed(small_s, (small_s, tiny_host, tiny)))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            a @ b
            torch.cuda.synchronize()
            out["matmul"].append(time.perf_counter() - t0)
        return out

    def stats(v: list[float]) -> tuple[float, float]:
        v = sorted(v)
        return statistics.median(v) * 1e6, v[int(0.9 * (len(v) - 1))] * 1e6

    sample()  # warm-up
    runs = {"alone": sample()}
    ctx = mp.get_context("spawn")
    for name, piece in (("beside whole copies", 0), ("beside 1 MiB pieces", 1 << 20)):
        ready, go = ctx.Event(), ctx.Event()
        p = ctx.Process(target=_copier, args=(mb, piece, 30.0, ready, go), daemon=True)
        p.start()
        if not ready.wait(120):
            p.kill()
            raise SystemExit("the copying process did not start")
        go.set()
        time.sleep(0.2)
        runs[name] = sample()
        p.kill()
        p.join()
    return {f"{k}, {w}": stats(v[k]) for w, v in runs.items() for k in v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=16, help="size of one copy (a record of 1024 tokens x 4 layers x 2048 x bf16 is 16 MiB)")
    ap.add_argument("--copies", type=int, default=64)
    ap.add_argument("--no-other-process", action="store_true", help="skip the test beside another process's copies")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("d2h_bandwidth needs a CUDA device")
    from layertap.engine.gpu_gather import register_host, unregister_host

    n = args.mb << 20
    src = torch.randn(n // 2, device="cuda", dtype=torch.bfloat16).view(torch.uint8)
    results: dict[str, float] = {}
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    results["pinned (cudaHostAlloc)"] = rate(pinned, src, args.copies, True)

    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        region = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
        err = register_host(region)
        if err is None:
            results["shm mapping + cudaHostRegister"] = rate(region, src, args.copies, True)
            hol = head_of_line(region, src)
            unregister_host(region)
        else:
            print(f"cudaHostRegister failed: {err}")
        results["shm mapping, pageable"] = rate(region, src, max(4, args.copies // 8), False)
        del region
        mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    pageable = torch.empty(n, dtype=torch.uint8)
    results["pageable (malloc)"] = rate(pageable, src, max(4, args.copies // 8), False)

    base = results["pinned (cudaHostAlloc)"]
    print(f"device-to-host, {args.mb} MiB per copy, {torch.cuda.get_device_name()}")
    for k, v in results.items():
        print(f"  {k:<34} {v:7.1f} GB/s  ratio {v / base:5.2f}")
    if err is None:
        print(f"  an 8-byte copy on its own stream, us (median of {HOL_REPS}): alone {hol['small alone']:.0f}, queued just "
              f"after a {args.mb} MiB copy into the registered mapping {hol['small after big']:.0f} (that copy alone: "
              f"{hol['big alone']:.0f}); after the same copy in 1 MiB pieces {hol['small after big in pieces']:.0f}")
    if not args.no_other_process:
        res = other_process(args.mb)
        print(f"  beside another process copying {args.mb} MiB records to the host back to back (its own CUDA context, "
              "as layertap's record process), us, median / p90:")
        for k, (med, p90) in res.items():
            print(f"    {k:<34} {med:8.0f} / {p90:8.0f}")
    tok = 4 * 2048 * 2
    print(f"  (a token of 4 layers x 2048 x bf16 is {tok} bytes: the registered pool carries "
          f"{results.get('shm mapping + cudaHostRegister', 0) * 1e9 / tok / 1e3:,.0f}K tokens/s)")


if __name__ == "__main__":
    main()
