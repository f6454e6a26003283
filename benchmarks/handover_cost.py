"""What the record process hand-over (``RecordProcess.send``, the ``send`` phase of ``record_writer.PHASES``) costs
the engine's step thread, and how much of it is pickling the descriptor: the real record process with a host
staging ring (``staging="host"``, rows left unwritten: ``rows="skip"``), records of ``--tokens`` token ids as
the scheduler hands them over (a list of ints), ``--records`` a step. Runs anywhere (no GPU).

    .venv/bin/python benchmarks/handover_cost.py --records 1,2,8 --steps 300

Prints per configuration the median microseconds a step of ``pickle.dumps`` of the descriptor as the scheduler's
lists make it (what ``send`` pickled until 2026-12-07: the ids as lists) and of the whole ``send`` (the ids packed
as int64 bytes, pickle, length prefix, pipe write), and their ratio: a send below the list pickle alone shows
what packing the ids saves.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layertap.engine.record_proc import RecordProcess  # noqa: E402
from layertap.records import LAYER_SEMANTICS  # noqa: E402
from layertap.transport.base import get_transport  # noqa: E402

RUN_META = {"model": "/tmp/bench", "config_hash": "0" * 16, "vllm_version": "none", "format_version": 1}
SHARED = {"layer_ids": [1], "layer_semantics": LAYER_SEMANTICS, "cache_group": {"index": 1}}
ROW_BYTES = 64


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", default="1,2,8", help="records a step (comma-separated)")
    ap.add_argument("--tokens", type=int, default=1024, help="token ids a record")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args(argv)
    shm = get_transport("shm")
    sizes = [int(x) for x in args.records.split(",")]
    cfg = shm.prepare({"slot_bytes": 1 << 20, "num_slots": 4 * max(sizes) + 16, "checksum": "none"})
    src = shm.make_source(cfg)
    rp = RecordProcess(transport_cfg={**cfg, "backend": "shm"}, run_meta=RUN_META, dtype_name="float32", n_planes=1,
                       hidden=ROW_BYTES // 4, row_bytes=ROW_BYTES, ring_bytes=64 << 20, staging="host",
                       start_timeout=60, rows="skip")
    rng = np.random.default_rng(0)
    print(f"{'records':>7}  {'list pickle us':>14}  {'send us':>8}  list pickle / send")
    rows = []
    try:
        for k in sizes:
            pk, sd = [], []
            for step in range(args.steps):
                items = []
                for r in range(k):
                    key = f"bench:{k}:{step}-{r}"
                    meta = {"key": key, "request_id": f"{step}-{r}", "index": step * k + r, "mode": "prompt",
                            "num_tokens": args.tokens, "num_prompt_tokens": args.tokens, "next_token_id": None,
                            "run": "bench"}
                    items.append((key, r * args.tokens, args.tokens, rng.integers(0, 150_000, args.tokens).tolist(),
                                  meta))
                nbytes = k * args.tokens * ROW_BYTES
                pos = rp.alloc(nbytes)
                t0 = time.perf_counter()
                pickle.dumps((pos, pos + nbytes, 0, items, None), protocol=pickle.HIGHEST_PROTOCOL)
                t1 = time.perf_counter()
                rp.send(pos, nbytes, 0, items, SHARED)
                t2 = time.perf_counter()
                pk.append(t1 - t0)
                sd.append(t2 - t1)
                got, deadline = 0, time.monotonic() + 30
                while got < k:  # the step's records committed and taken before the next step is timed
                    if time.monotonic() > deadline:
                        raise SystemExit(f"step {step}: {got} of {k} records committed within 30 s")
                    for rec in src.poll(1.0):
                        rec.release()
                        got += 1
            p, s = statistics.median(pk) * 1e6, statistics.median(sd) * 1e6
            print(f"{k:>7}  {p:>14.1f}  {s:>8.1f}  {p / s:.2f}", flush=True)
            rows.append({"records": k, "pickle_us": p, "send_us": s, "steps": args.steps})
    finally:
        rp.close()
        src.close()
        shm.cleanup(cfg)
    return rows


if __name__ == "__main__":
    main()
