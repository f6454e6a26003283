"""Engine start-up on a bare machine, timed and watched (the "first Tap start printed 'Using V2 Model
Runner' and then nothing for 9 minutes" report of 2026-12-01).

In order, in one process: the first Tap start of the run (a small Llama, bf16, compiled, prefix caching,
chunked prefill) with a short capture, a plain ``vllm.LLM`` start of the same model, and a second Tap
start. Every Tap start runs under layertap's start-up watchdog (``--start-timeout``): a hang ends in
``EngineStartTimeout`` with the report of where the engine's processes stand (state, kernel wait, Python
stacks, last log lines), which this script prints and stores; plain starts get the same watchdog. Prints one line per start; ``--json``
writes them.

    python benchmarks/startup_probe.py --json startup.json --start-timeout 300
"""

from __future__ import annotations

import argparse
import json
import os
import time

from layertap.engine import watchdog

# vLLM spawns its engine processes, which import this module as __mp_main__: there this registers the
# watchdog's stack dumps (plain vLLM engines do not load layertap's worker class, which does it otherwise).
watchdog.register_stack_dumps()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plain-spawn", action="store_true", help="start the plain engines with spawn too")
    ap.add_argument("--starts", default="tap,plain,tap,plain", help="comma-separated: tap | plain, in order")
    args = ap.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    from layertap.engine.watchdog import EngineTimeout
    from layertap.models.tiny import tiny_model
    from layertap.tap import Tap

    model = tiny_model("llama", hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128,
                       intermediate_size=2816)
    eng = dict(dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048, max_num_batched_tokens=512,
               enable_prefix_caching=True)
    prompts = [{"token_ids": [(7 * i + j) % 2000 + 10 for j in range(300 + 40 * i)]} for i in range(8)]
    rows = []
    for k, kind in enumerate(args.starts.split(",")):
        t0 = time.monotonic()
        row = {"start": k, "kind": kind}
        try:
            if kind == "tap":
                with Tap(model=model, layers=[2, 4, 8], start_timeout=args.start_timeout, **eng) as tap:
                    row["start_s"] = round(time.monotonic() - t0, 1)
                    recs = list(tap.capture(prompts))
                    row["records"] = len(recs)
            else:
                wd = watchdog.Watchdog(args.start_timeout, 600, watchdog.new_diag_dir())
                os.environ[watchdog.DIAG_ENV] = str(wd.diag)
                if args.plain_spawn:  # what a Tap sets (launch.engine_env); plain vLLM forks by default
                    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
                try:
                    with wd.starting():
                        llm = LLM(model=str(model), **eng)
                finally:
                    os.environ.pop(watchdog.DIAG_ENV, None)
                    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
                    wd.close()
                row["start_s"] = round(time.monotonic() - t0, 1)
                llm.generate([{"prompt_token_ids": p["token_ids"]} for p in prompts],
                             SamplingParams(max_tokens=1), use_tqdm=False)
                llm.llm_engine.engine_core.shutdown()
                del llm
            row["ok"] = True
        except EngineTimeout as e:
            row.update(ok=False, error=type(e).__name__, report=str(e))
        row["total_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        print(f"start {k} ({kind}): " + json.dumps({x: v for x, v in row.items() if x != "report"}), flush=True)
        if "report" in row:
            print(row["report"], flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M:%S"), "starts": rows}, f, indent=1)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
