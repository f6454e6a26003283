"""Transport throughput: producer process -> consumer process, per backend and record size, next to memcpy.

    python benchmarks/transport.py [--backends file,shm,mooncake] [--sizes-mb 1,16,64] [--checksum crc32]
    python benchmarks/transport.py compact          # bytes/token and reconstruction error per option

A spawned producer puts ``count`` records of ``size`` bytes (fp32 hidden states, one record's tensors
reused) through a real sink; this process consumes them through the backend's source (which verifies
each one: checksum + token digest) and releases them. GB/s = bytes delivered / (first put -> last record
received). The memcpy baseline copies a buffer of the same size between two reused numpy arrays in this
same run, so the ratio is comparable on a busy machine. Mooncake needs a running master
(``--mooncake-master host:port``; start one with ``mooncake_master --rpc_address=127.0.0.1 ...``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layertap.records import token_digest  # noqa: E402
from layertap.transport.base import get_transport  # noqa: E402

HIDDEN = 4096


def make_record(size: int, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tokens = max(1, size // (HIDDEN * 4))
    ids = torch.arange(tokens, dtype=torch.int64)
    hs = torch.randn(tokens, 1, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return {"token_ids": ids, "hidden_states": hs}, {"layer_ids": [0], "token_digest": token_digest(ids)}


def memcpy_gbps(size: int, reps: int = 10) -> float:
    a = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times) / 1e9


def _producer(name: str, cfg: dict[str, Any], size: int, count: int, ready: Any, start: Any, err: Any) -> None:
    try:
        sink = get_transport(name).make_sink(cfg, "bench")
        tensors, meta = make_record(size)
        ready.set()
        start.wait()
        for i in range(count):
            sink.put(f"r{i}", tensors, {**meta, "index": i, "key": f"r{i}"})
        sink.flush()
        sink.close()
    except Exception as e:  # reported to the parent, which raises it
        err.put(f"{type(e).__name__}: {e}")


def run_one(name: str, cfg: dict[str, Any], size: int, count: int) -> float:
    t = get_transport(name)
    cfg = t.prepare(cfg)
    ctx = mp.get_context("spawn")
    ready, start, err = ctx.Event(), ctx.Event(), ctx.Queue()
    src = t.make_source(cfg)
    proc = ctx.Process(target=_producer, args=(name, cfg, size, count, ready, start, err))
    proc.start()
    try:
        while not ready.wait(1.0):  # the producer's imports and connection are not part of the timing
            if not proc.is_alive():
                raise RuntimeError(f"producer exited {proc.exitcode} before it was ready: {err.get(timeout=1)}")
        got, nbytes = 0, 0
        t0 = time.perf_counter()
        start.set()
        while got < count:
            for rec in src.poll(1.0):
                nbytes += rec.hidden_states.numel() * rec.hidden_states.element_size()
                got += 1
                rec.release()
            if not err.empty():
                raise RuntimeError(f"producer failed: {err.get()}")
            if not proc.is_alive() and proc.exitcode not in (0, None) and got < count:
                raise RuntimeError(f"producer exited {proc.exitcode} after {got} records")
        elapsed = time.perf_counter() - t0
    finally:
        proc.join(30)
        src.close()
        t.cleanup(cfg)
    return nbytes / elapsed / 1e9


def backend_config(name: str, size: int, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    if name == "file":
        return {"path": tempfile.mkdtemp(dir=tmp), "fsync": False}
    if name == "shm":
        return {"slot_bytes": size + (1 << 20), "num_slots": 4, "checksum": args.checksum}
    if name == "mooncake":
        return {"master": args.mooncake_master, "segment_bytes": 4 * size + (64 << 20),
                "buffer_bytes": size + (64 << 20), "checksum": args.checksum}
    raise ValueError(f"unknown backend {name}")


def throughput(args: argparse.Namespace) -> None:
    counts = {1: 200, 16: 40, 64: 12}
    print(f"{'backend':9} {'size':>6} {'count':>5} {'GB/s':>7} {'memcpy':>7} {'ratio':>6}")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for name in args.backends.split(","):
            for mb in (int(s) for s in args.sizes_mb.split(",")):
                size, count = mb << 20, counts.get(mb, max(8, 256 // mb))
                gbps = run_one(name, backend_config(name, size, args, tmp), size, count)
                base = memcpy_gbps(size)
                print(f"{name:9} {mb:>4}MB {count:>5} {gbps:>7.2f} {base:>7.2f} {gbps / base:>6.2f}", flush=True)


def compact_report() -> None:
    """Bytes/token and relative reconstruction error for each compact option on a synthetic record."""
    from layertap.records import deserialize, serialize, to_record
    from layertap.transport.compact import compact

    g = torch.Generator().manual_seed(0)
    tokens, layers, hidden = 2048, 3, 4096
    hs = torch.randn(tokens, layers, hidden, generator=g)
    hs[:, :, :8] *= 30  # a few outlier channels, as real residual streams have (massive activations)
    ids = torch.randint(0, 32000, (tokens,), generator=g)
    mask = torch.zeros(tokens, dtype=torch.uint8)
    for start in range(0, tokens, 512):  # 4 turns: 256 prompt tokens then 256 assistant tokens
        mask[start + 256 : start + 512] = 1
    tensors = {"token_ids": ids, "hidden_states": hs, "loss_mask": mask}
    meta = {"index": 0, "key": "bench", "layer_ids": [0, 1, 2], "token_digest": token_digest(ids)}
    print(f"record: {tokens} tokens x {layers} layers x {hidden} hidden, {int(mask.sum())} loss-masked tokens")
    print(f"{'only_masked':11} {'dtype':5} {'bytes/token':>12} {'vs fp32 all':>11} {'rel err':>9} {'max abs err':>11}")
    base = None
    for only in (False, True):
        for dtype in ("fp32", "fp16", "bf16", "fp8"):
            blob = serialize(*compact(tensors, meta, only_loss_masked=only, dtype=dtype))
            rec = to_record(*deserialize(blob))
            ref = hs if rec.positions is None else hs[rec.positions]
            diff = rec.hidden_states.float() - ref
            rel = float(diff.norm() / ref.norm())
            base = base or len(blob)
            print(f"{str(only):11} {dtype:5} {len(blob) / tokens:>12.0f} {len(blob) / base:>11.3f} "
                  f"{rel:>9.2e} {float(diff.abs().max()):>11.3e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="throughput", choices=["throughput", "compact"])
    p.add_argument("--backends", default="file,shm", help="comma-separated backends (default file,shm)")
    p.add_argument("--sizes-mb", default="1,16,64", help="record sizes in MiB (default 1,16,64)")
    p.add_argument("--checksum", default="crc32", choices=["crc32", "sum64", "none"],
                   help="payload checksum for shm/mooncake (default crc32)")
    p.add_argument("--mooncake-master", default="127.0.0.1:50051", help="host:port of a running mooncake_master")
    p.add_argument("--tmp", default=None, help="directory for the file backend's dataset (default: system tmp)")
    args = p.parse_args()
    throughput(args) if args.what == "throughput" else compact_report()


if __name__ == "__main__":
    main()
