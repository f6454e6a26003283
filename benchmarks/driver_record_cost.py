"""The driving process's work per record: what the Tap does for each record between two engine steps, on a
real shm pool. A writer commits one record at a time (as the engine's worker does); the driver side then
takes it off the pool and proves it as ``Tap._loop`` does:

    poll      ``ShmSource.poll``: the slot table scan, the header, the record's tensors, its digest check
    expect    the digest of the submitted tokens, against the engine's (``Tap._prove``)
    prove     the digest of the record's token ids, against the same (``Tap._prove``)
    release   the slot back to the pool, the writers' bells rung

(Until 2026-12-04 ``prove`` compared the record's token ids as a Python list, 18 us here; the digest takes 8.
Since 2026-12-05 it reuses the digest ``poll``'s check computed, ``Record.checked_digest``.)

Prints microseconds per record for each piece and, as the ratio, the whole against an empty poll (the
driver's loop with no record to take). At 1-16 requests in flight on the GPU this work sits between an engine
output and the driver's next step call (``capture_overhead.py --stats``: the ``out`` phase).

    python benchmarks/driver_record_cost.py                                # 1024 rows x 4 layers x 2048, bf16
    python benchmarks/driver_record_cost.py --rows 256 --hidden 512 --iters 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> dict[str, float]:
    from layertap.records import LAYER_SEMANTICS, token_digest
    from layertap.transport.base import get_transport

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args(argv)

    ids = list(range(args.rows))
    hs = torch.zeros(args.rows, args.layers, args.hidden, dtype=torch.bfloat16)
    slot_mb = -(-(hs.numel() * 2 + args.rows * 9 + (64 << 10)) >> 20)
    tr = get_transport("shm")
    cfg = {**tr.prepare({"slot_mb": slot_mb, "slots": 8}), "backend": "shm"}
    src, sink = tr.make_source(cfg), tr.make_sink(cfg, "bench-writer")
    meta = {"index": 0, "request_id": "r", "mode": "prompt", "layer_ids": list(range(1, args.layers + 1)),
            "num_tokens": args.rows, "num_prompt_tokens": args.rows, "token_digest": token_digest(ids),
            "layer_semantics": LAYER_SEMANTICS, "run": "bench", "dtype": "bfloat16"}
    parts: dict[str, list[float]] = {k: [] for k in ("poll", "expect", "prove", "release", "empty poll")}
    try:
        for i in range(args.warmup + args.iters):
            key = f"bench:{i}"
            sink.put(key, {"token_ids": torch.tensor(ids, dtype=torch.int64), "hidden_states": hs}, {**meta, "key": key})
            t0 = time.perf_counter()
            recs = src.poll(0.0)
            t1 = time.perf_counter()
            want = token_digest(ids)
            t2 = time.perf_counter()
            if len(recs) != 1 or want != recs[0].meta["token_digest"] or recs[0].checked_digest() != want:
                raise SystemExit(f"record {key}: not taken back whole ({len(recs)} records)")
            t3 = time.perf_counter()
            recs[0].release()
            t4 = time.perf_counter()
            src.poll(0.0)
            t5 = time.perf_counter()
            if i >= args.warmup:
                for k, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                    parts[k].append(dt * 1e6)
    finally:
        sink.close()
        src.close()
        tr.cleanup(cfg)
    med = {k: statistics.median(v) for k, v in parts.items()}
    total = sum(med[k] for k in ("poll", "expect", "prove", "release"))
    print(f"driver work per record ({args.rows} rows x {args.layers} layers x {args.hidden}, bf16; median of "
          f"{args.iters}, us): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print(f"per record {total:.1f} us; ratio to an empty poll: {total / max(med['empty poll'], 1e-3):.1f}x")
    return {**med, "total": total}


if __name__ == "__main__":
    main()
