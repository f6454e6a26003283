"""Transport throughput: producer process -> consumer process, per backend and record size, next to memcpy.

    python benchmarks/transport.py [--backends file,shm,mooncake] [--sizes-mb 1,16,64] [--checksum crc32]
    python benchmarks/transport.py compact          # bytes/token and reconstruction error per option
    python benchmarks/transport.py per-record       # the shm pool's per-record Python costs (see per_record)

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


# The per-record measurement, run in a child process against one checkout of layertap (``sys.argv[1]``: its
# root), so two checkouts can be timed in interleaved rounds of one run. Only public transport calls.
_PER_RECORD_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from layertap.records import token_digest
from layertap.transport.shm import ShmTransport
slots, n = int(sys.argv[2]), int(sys.argv[3])
cfg = ShmTransport.prepare({"slot_bytes": 1 << 16, "num_slots": slots, "checksum": "none"})
src, sink = ShmTransport.make_source(cfg), ShmTransport.make_sink(cfg, "bench")
run_meta = {"model": "/tmp/layertap-cache/bench-0123456789ab", "config_hash": "0123456789abcdef",
            "vllm_version": "0.25.1", "layer_semantics": "id i = residual stream entering decoder layer i "
            "(hidden+residual); id 0 = embedding output; id num_hidden_layers = last layer output before the "
            "final norm", "num_hidden_layers": 16, "hidden_size": 2048, "format_version": 1}
ids = list(range(1024))
digest = token_digest(ids)
# 1024 rows, as a 1024-token prompt has; a narrow payload, so hundreds of slots fit in /dev/shm
specs = {"token_ids": (torch.int64, (1024,)), "hidden_states": (torch.bfloat16, (1024, 4, 4))}
t = {"producer": 0.0, "consumer": 0.0, "admission": 0.0}
try:
    for i in range(n + 50):
        t0 = time.perf_counter()
        meta = {**run_meta, "key": f"r-{i}", "index": i, "request_id": f"r-{i}-1-0123abcd", "mode": "prompt",
                "run": "bench", "num_rows": 1024, "token_digest": digest, "layer_ids": [1, 8, 13, 16],
                "dtype": "bfloat16"}
        res = sink.reserve(f"r-{i}", specs, meta)
        res.tensors["token_ids"].numpy()[:] = ids
        res.commit()
        t1 = time.perf_counter()
        for rec in src.poll(0):
            rec.release()
        t2 = time.perf_counter()
        src.free_capacity()
        t3 = time.perf_counter()
        if i >= 50:
            t["producer"] += t1 - t0; t["consumer"] += t2 - t1; t["admission"] += t3 - t2
finally:
    src.close()
print(json.dumps({k: v / n for k, v in t.items()}))
"""


def per_record(args) -> None:
    """What one record costs in Python on each side of an shm pool of ``--slots`` slots (default 528, the
    GPU capture benchmark's pool), no payload bytes moved: the producer's reserve + token fill + commit (the
    engine's step thread pays it per record), the consumer's poll + deliver + release, and the Tap's
    admission check (``free_capacity``, asked before every request it admits). ``--baseline-tree DIR``
    (another checkout, e.g. ``git worktree add /tmp/base HEAD~1``) is timed in the same run, rounds
    interleaved, each in a fresh process; ratio = this tree / baseline, median over rounds."""
    import json
    import subprocess

    trees = {"this": str(Path(__file__).resolve().parents[1])}
    if args.baseline_tree:
        trees["baseline"] = str(Path(args.baseline_tree).resolve())
    got: dict[str, list[dict]] = {k: [] for k in trees}
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(trees)[::-1]
        for k in order:
            r = subprocess.run([sys.executable, "-c", _PER_RECORD_CHILD, trees[k], str(args.slots), str(args.count)],
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                raise SystemExit(f"per-record child ({k}: {trees[k]}) failed:\n{r.stderr[-3000:]}")
            got[k].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"per-record Python costs of an shm pool of {args.slots} slots ({args.count} records per round, "
          f"{args.rounds} rounds; median us per record)" + (f"; baseline {trees['baseline']}" if "baseline" in trees else ""))
    print(f"{'what':40} {'this tree':>10} " + (f"{'baseline':>10} {'ratio [min-max]':>20}" if "baseline" in trees else ""))
    for what, label in [("producer", "producer: reserve + token fill + commit"),
                        ("consumer", "consumer: poll + deliver + release"),
                        ("admission", "Tap's admission check (free_capacity)")]:
        this = statistics.median(x[what] for x in got["this"])
        line = f"{label:40} {this * 1e6:>10.1f} "
        if "baseline" in got:
            ratios = [a[what] / b[what] for a, b in zip(got["this"], got["baseline"])]
            line += (f"{statistics.median(x[what] for x in got['baseline']) * 1e6:>10.1f} "
                     f"{statistics.median(ratios):>8.3f} [{min(ratios):.2f}-{max(ratios):.2f}]")
        print(line)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", default="throughput", choices=["throughput", "compact", "per-record"])
    p.add_argument("--slots", type=int, default=528, help="per-record: pool slots (default 528)")
    p.add_argument("--count", type=int, default=2000, help="per-record: records / calls timed (default 2000)")
    p.add_argument("--rounds", type=int, default=6, help="per-record: interleaved rounds (default 6)")
    p.add_argument("--baseline-tree", default=None, help="per-record: another layertap checkout timed beside this one")
    p.add_argument("--backends", default="file,shm", help="comma-separated backends (default file,shm)")
    p.add_argument("--sizes-mb", default="1,16,64", help="record sizes in MiB (default 1,16,64)")
    p.add_argument("--checksum", default="crc32", choices=["crc32", "sum64", "none"],
                   help="payload checksum for shm/mooncake (default crc32)")
    p.add_argument("--mooncake-master", default="127.0.0.1:50051", help="host:port of a running mooncake_master")
    p.add_argument("--tmp", default=None, help="directory for the file backend's dataset (default: system tmp)")
    args = p.parse_args()
    {"throughput": throughput, "compact": lambda _: compact_report(), "per-record": per_record}[args.what](args)


if __name__ == "__main__":
    main()
