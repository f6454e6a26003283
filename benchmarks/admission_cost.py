"""What admitting one request costs the driving process: ``LLMEngine.add_request`` with a token-id prompt (vLLM
processes it, then registers and sends it), against the same request built beforehand through
``compat.request_builder`` and then only sent (``compat.send_built``: what ``Tap.prebuild`` leaves between a
finished request and its successor's admission). One engine, one process; each request runs to completion
before the next, so the engine is idle while the driver admits.

    python benchmarks/admission_cost.py [--prompt-len 1024] [--iters 300]

Prints the median microseconds of each and the ratio (built ahead / at admission).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams, TokensPrompt

    from layertap.engine import compat
    from layertap.models.tiny import tiny_model

    llm = LLM(model=str(tiny_model()), max_model_len=args.prompt_len + 8, enforce_eager=True, dtype="float32")
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    sp.extra_args = {"kv_transfer_params": {"layertap": {"index": 0, "mode": "prompt", "run": "bench"}}}
    ids = [5 + i % 1000 for i in range(args.prompt_len)]
    build = compat.request_builder(eng, compat.check_version())
    if build is None:
        raise SystemExit("this vLLM has no request-building seam (compat.request_builder)")
    whole, built, sent = [], [], []
    for i in range(args.warmup + args.iters):  # alternating: both see the same machine state
        t0 = time.perf_counter()
        eng.add_request(f"a{i}", TokensPrompt(prompt_token_ids=ids), sp)
        whole.append(time.perf_counter() - t0)
        while eng.has_unfinished_requests():
            eng.step()
        t0 = time.perf_counter()
        req = build(f"b{i}", TokensPrompt(prompt_token_ids=ids), sp)
        t1 = time.perf_counter()
        compat.send_built(eng, req, sp)
        t2 = time.perf_counter()
        built.append(t1 - t0)
        sent.append(t2 - t1)
        while eng.has_unfinished_requests():
            eng.step()
    med = {k: statistics.median(v[args.warmup:]) * 1e6 for k, v in (("whole", whole), ("built", built), ("sent", sent))}
    print(f"admission of a {args.prompt_len}-token request (median of {args.iters}, us): at admission "
          f"{med['whole']:.0f}; built ahead {med['built']:.0f}, then sent {med['sent']:.0f}; "
          f"ratio (sent / at admission) {med['sent'] / med['whole']:.2f}")


if __name__ == "__main__":
    main()
