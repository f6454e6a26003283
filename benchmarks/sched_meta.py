"""Per-step cost of the connector's scheduler side (``SchedulerSide.build_meta``) on decode steps, in this
process, no engine: the steady-state fast path against the full per-request pass (``_build_meta``, what every
step ran before) on the same synthetic scheduler outputs, interleaved rounds, ratio printed.

    .venv/bin/python benchmarks/sched_meta.py              # 1, 16, 64 requests in flight
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace as NS

from layertap.engine.saves import SchedulerSide


def side() -> SchedulerSide:
    c = NS(_group=0, _check_steps=4, _layer_ids=[1, 8, 13, 16], _group_desc={},
           _extra={"capture_path": "hook", "default_mode": "generate", "capture_all": True})
    return SchedulerSide(c)


def decode_out(n: int, step: int) -> NS:
    """A decode step of ``n`` generate-mode requests; one in 16 gets a new block (block size 16)."""
    rids = [f"r{i}" for i in range(n)]
    cached = NS(req_ids=rids, resumed_req_ids=set(), num_computed_tokens=[512 + step] * n,
                num_output_tokens=[1 + step] * n,
                new_block_ids=[([100 + i],) if (step + i) % 16 == 0 else None for i in range(n)])
    return NS(num_scheduled_tokens={r: 1 for r in rids}, scheduled_new_reqs=[], scheduled_cached_reqs=cached)


def per_step_us(fn, outs) -> float:
    t = time.perf_counter()
    for o in outs:
        fn(o)
    return 1e6 * (time.perf_counter() - t) / len(outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inflight", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print("in flight  full pass us/step  fast path us/step  ratio (fast / full) [min-max]")
    for n in map(int, args.inflight.split(",")):
        s = side()
        for i in range(n):
            s.params[f"r{i}"] = {"mode": "generate"}
            s.blocks[f"r{i}"] = list(range(32))
        s.steps = s.decode_steps = s.c._check_steps  # past the first steps' slot checks
        outs = [decode_out(n, k) for k in range(400)]
        full, fast = [], []
        for _ in range(args.rounds):
            full.append(per_step_us(lambda o: s._build_meta(o, []), outs))
            fast.append(per_step_us(s.build_meta, outs))
        ratios = [b / a for a, b in zip(full, fast)]
        print(f"{n:9d}  {statistics.median(full):16.2f}  {statistics.median(fast):17.2f}  "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
