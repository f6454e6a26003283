"""Capture overhead: the same prefill workload through plain vLLM, through vLLM with layertap capture, and
through an HF transformers second pass (what users do without layertap). One process, one run.

Prints tokens/s of each and the ratios, per in-flight batch size. Records must be complete when the
capture call returns: they are counted (and each one's token digest proven by the Tap).

Variants (``--variants``; the ratio column is ``capture`` over ``plain``, the others explain the gap):
    plain           vLLM as users run it (its default scheduling)
    plain-sync      vLLM with async_scheduling=False
    floor           the hook capture engine + the layertap connector, reading no rows (the cost of the
                    model writing its rows into the capture layer)
    capture         layertap capture (default: hook path, vLLM's default scheduling, records written in
                    place in the shm pool)
    capture-staged  capture, rows staged through a pinned buffer, then copied into the pool
    capture-sync    capture with async_scheduling=False
    floor-extract   as floor, through vLLM's extract_hidden_states (capture_path="extract")
    capture-extract capture through extract_hidden_states (synchronous scheduling on vLLM 0.25/CUDA)
    capture-extract-async  the same with async_scheduling=True (allowed for prompt mode)

    python benchmarks/capture_overhead.py                       # CPU: tiny model, small workload
    python benchmarks/capture_overhead.py --hidden 2048 --num-layers 16 --prompts 256 --prompt-len 1024 \
        --batch-sizes 1,4,16,64 --dtype bfloat16                # GPU (see scripts/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def build_model(args) -> Path:
    from layertap.models.tiny import TinySpec, build_tiny_model, default_cache_dir, spec_hash

    heads = max(1, args.hidden // args.head_dim)
    spec = TinySpec(kind="qwen3", hidden_size=args.hidden, num_layers=args.num_layers, num_heads=heads,
                    num_kv_heads=max(1, heads // 4) if heads >= 4 else heads, head_dim=args.head_dim,
                    intermediate_size=args.hidden * 3, vocab_size=args.vocab, max_position_embeddings=8192)
    return build_tiny_model(default_cache_dir() / f"bench-{spec_hash(spec)}", spec)


def prompts(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, args.vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def drive(engine, batch: list[list[int]], inflight: int, params_for) -> int:
    """Run every prompt with at most ``inflight`` requests in the engine; returns tokens processed."""
    from vllm import TokensPrompt

    todo = list(enumerate(batch))[::-1]
    running, tokens = 0, 0
    while todo or running:
        while todo and running < inflight:
            i, ids = todo.pop()
            engine.add_request(f"plain-{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=ids), params_for(i))
            running += 1
            tokens += len(ids)
        for out in engine.step():
            running -= out.finished
    return tokens


def engine_kwargs(args) -> dict:
    kw = dict(dtype=args.dtype, max_model_len=args.prompt_len + 8, max_num_seqs=max(args.batch_sizes),
              max_num_batched_tokens=max(args.max_num_batched_tokens, args.prompt_len),
              enable_prefix_caching=False, enforce_eager=args.eager)
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = args.gpu_mem
    else:
        kw["kv_cache_memory_bytes"] = 512 << 20
    return kw


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _rates(engine, data, args, params_for) -> dict[int, float]:
    drive(engine, data[: max(args.batch_sizes)], max(args.batch_sizes), params_for)  # warm-up
    out = {}
    for b in args.batch_sizes:
        t0 = time.perf_counter()
        n = drive(engine, data, b, params_for)
        out[b] = n / (time.perf_counter() - t0)
    return out


def bench_plain(model, data, args, **extra) -> dict[int, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model), **engine_kwargs(args), **extra)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        return _rates(llm.llm_engine, data, args, lambda i: sp)
    finally:
        shutdown(llm)


def bench_floor(model, data, args, path: str = "hook") -> dict[int, float]:
    """The capture path's engine + the connector, which reports every save done without reading a row."""
    from vllm import LLM, SamplingParams

    from layertap.engine import compat
    from layertap.engine.connector import PARAMS_KEY

    v = compat.check_version()
    kw = {**compat.engine_defaults(v, torch.cuda.is_available(), {}, path), **engine_kwargs(args)}
    extra = {"transport": {"backend": "shm"}, "run_meta": {}, "skip_reads": True, "capture_path": path,
             "layer_ids": list(args.layers)}
    llm = LLM(model=str(model), **compat.engine_capture_kwargs(path, args.layers, kw),
              kv_transfer_config=compat.kv_transfer_config(extra), **kw)

    def params_for(i):
        sp = SamplingParams(max_tokens=1, temperature=0.0)
        sp.extra_args = {"kv_transfer_params": {PARAMS_KEY: {"index": i, "mode": "prompt", "run": "floor"}}}
        return sp

    try:
        return _rates(llm.llm_engine, data, args, params_for)
    finally:
        shutdown(llm)


def bench_capture(model, data, args, **extra) -> dict[int, float]:
    from layertap.tap import Tap

    out = {}
    tap = Tap(model=model, layers=args.layers, transport=args.transport,
              transport_config={"slot_bytes": args.slot_mb << 20, "num_slots": args.shm_slots, "checksum": args.checksum}
              if args.transport == "shm" else None,
              out=args.out if args.transport == "file" else None, zero_copy=args.transport == "shm",
              **engine_kwargs(args), **extra)
    try:
        inputs = [{"token_ids": ids} for ids in data]
        tap.max_inflight = max(args.batch_sizes)
        for rec in tap.capture(inputs[: max(args.batch_sizes)]):  # warm-up
            rec.release()
        for b in args.batch_sizes:
            tap.max_inflight = b
            t0 = time.perf_counter()
            count = 0
            for rec in tap.capture(inputs):
                count += 1
                rec.release()
            dt = time.perf_counter() - t0
            if count != len(inputs):
                raise SystemExit(f"capture returned {count} records for {len(inputs)} requests")
            out[b] = len(inputs) * args.prompt_len / dt
    finally:
        tap.close()
    return out


VARIANTS = {
    "plain": lambda m, d, a: bench_plain(m, d, a),
    "plain-sync": lambda m, d, a: bench_plain(m, d, a, async_scheduling=False),
    "floor": bench_floor,
    "capture": lambda m, d, a: bench_capture(m, d, a),
    "capture-staged": lambda m, d, a: bench_capture(m, d, a, connector_options={"direct": False}),
    "capture-sync": lambda m, d, a: bench_capture(m, d, a, async_scheduling=False),
    "floor-extract": lambda m, d, a: bench_floor(m, d, a, path="extract"),
    "capture-extract": lambda m, d, a: bench_capture(m, d, a, capture_path="extract"),
    "capture-extract-async": lambda m, d, a: bench_capture(m, d, a, capture_path="extract", async_scheduling=True),
}


@torch.no_grad()
def bench_hf(model, data, args) -> float:
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(dev).eval()
    bs = args.hf_batch

    def run(rows):
        for i in range(0, len(rows), bs):
            ids = torch.tensor(rows[i : i + bs], device=dev)
            hs = m.model(input_ids=ids, output_hidden_states=True).hidden_states
            host = [hs[j].to("cpu") for j in args.layers if j < len(hs)]  # what a user stores
            del host

    run(data[:bs])
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(data)
    if dev == "cuda":
        torch.cuda.synchronize()
    rate = len(data) * args.prompt_len / (time.perf_counter() - t0)
    del m
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="captured layer ids (default: 4 ids spread over the model, as an EAGLE-3 run would)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    ap.add_argument("--gpu-mem", type=float, default=0.35)
    ap.add_argument("--transport", default="shm", choices=["shm", "file"])
    ap.add_argument("--checksum", default="none",
                    help="shm payload checksum (crc32|sum64|none; the token digest is always checked)")
    ap.add_argument("--shm-slots", type=int, default=16)
    ap.add_argument("--slot-mb", type=int, default=64, help="shm slot size in MiB")
    ap.add_argument("--out", default="/dev/shm/layertap-bench", help="file transport: dataset directory")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of every vLLM engine")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["plain", "capture"],
                    help=f"comma-separated, from {list(VARIANTS)}; must include plain and capture")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF second pass")
    ap.add_argument("--in-process", action="store_true",
                    help="run every variant in this process (default: one child process per variant; on the H200 "
                         "an engine started in the same process after a closed capture engine hung at start-up)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: "VARIANT:RESULT.json"
    args = ap.parse_args()
    n = args.num_layers
    args.layers = args.layers or sorted({1, max(1, n // 2), max(1, n - 3), n})
    for v in args.variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; expected some of {list(VARIANTS)}")
    if "plain" not in args.variants:
        raise SystemExit("--variants must include plain (every ratio is over plain)")
    model = build_model(args)
    data = prompts(args)
    if args.child:
        v, path = args.child.split(":", 1)
        Path(path).write_text(json.dumps(VARIANTS[v](model, data, args)))
        return
    res = {}
    for v in args.variants:
        print(f"--- {v}", flush=True)
        if args.in_process:
            res[v] = VARIANTS[v](model, data, args)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                rc = subprocess.call([sys.executable, __file__, *sys.argv[1:], "--child", f"{v}:{out}"])
                if rc != 0 or not out.exists():
                    raise SystemExit(f"variant {v} failed (exit {rc})")
                res[v] = {int(b): r for b, r in json.loads(out.read_text()).items()}
        print(f"--- {v}: " + ", ".join(f"{b}: {r:.0f} tok/s" for b, r in res[v].items()), flush=True)
    hf = bench_hf(model, data, args) if not args.no_hf else float("nan")
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\ncapture overhead on {dev}: {args.prompts} x {args.prompt_len}-token prefill, hidden {args.hidden}, "
          f"{n} layers, {args.dtype}, {'eager' if args.eager else 'compiled'}, layers {args.layers}, "
          f"transport {args.transport}, tensor parallel {args.tp}")
    if "capture" not in res:
        for v in args.variants:
            print(f"{v}: " + ", ".join(f"{b}: {res[v][b]:.0f} tok/s ({res[v][b] / res['plain'][b]:.2f})" for b in args.batch_sizes))
        return
    others = [v for v in args.variants if v not in ("plain", "capture")]
    print(f"{'in-flight':>9} {'plain tok/s':>12} {'capture tok/s':>14} {'ratio':>6} {'vs HF':>6}"
          + "".join(f" {v + ' (ratio)':>24}" for v in others))
    rows = []
    for b in args.batch_sizes:
        plain, cap = res["plain"][b], res["capture"][b]
        r = {"batch": b, "plain": plain, "capture": cap, "ratio": cap / plain, "vs_hf": cap / hf,
             **{v: res[v][b] for v in others}}
        rows.append(r)
        print(f"{b:>9} {plain:>12.0f} {cap:>14.0f} {r['ratio']:>6.2f} {r['vs_hf']:>5.1f}x"
              + "".join(f" {res[v][b]:>15.0f} ({res[v][b] / plain:.2f})" for v in others))
    print(f"HF transformers second pass (batch {args.hf_batch}, layers copied to host): {hf:.0f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "args": vars(args), "rows": rows, "hf": hf}, indent=1))


if __name__ == "__main__":
    main()
