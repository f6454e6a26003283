"""The EAGLE-3 trainer's step with its batch built on the host (then copied) against built on the device.

``Trainer.train_step`` of the real trainer on records shaped like the GPU loop's (bf16 rows of 4 planes:
three aux ids and the last one, hidden 2048, 150-350 tokens, 8 records a step, TTT 4), each step timed
from the records to the optimizer step's end. Two ways to make the batch, in one process, rounds
interleaved:

- ``host``: ``collate`` in host memory (a fresh float32 buffer, the bf16 -> float32 pass on the CPU), then
  the float32 batch copied to the device (what the trainer did before 2026-12-03);
- ``device``: ``collate(..., device=trainer.device)``: each record's bf16 rows copied, padded and widened
  on the device.

Prints ms per step (median over rounds) and the ratio host / device; ``--json`` writes them.

    python benchmarks/train_data_path.py                # CUDA: the GPU loop's shape
    python benchmarks/train_data_path.py --small        # CPU smoke run (hidden 256)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from layertap.models.tiny import TinySpec, build_tiny_model  # noqa: E402
from layertap.records import Record  # noqa: E402
from layertap.train.config import DrafterShape, Eagle3Config, TrainConfig  # noqa: E402
from layertap.train.data import collate  # noqa: E402
from layertap.train.trainer import Trainer  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--inter", type=int, default=6144)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="records per step")
    p.add_argument("--min-len", type=int, default=150)
    p.add_argument("--max-len", type=int, default=350)
    p.add_argument("--ttt", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--small", action="store_true", help="CPU smoke dims (hidden 256, 2 steps, 2 rounds)")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def make_records(a: argparse.Namespace, n: int, dtype: torch.dtype) -> list[Record]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        k = int(torch.randint(a.min_len, a.max_len + 1, (1,), generator=g))
        hs = torch.randn(k, 4, a.hidden, generator=g).to(dtype)
        out.append(Record(index=i, token_ids=torch.randint(0, a.vocab, (k,), generator=g), hidden_states=hs,
                          layer_ids=[1, 2, 3, 4], num_prompt_tokens=k // 3, loss_mask=None, meta={}))
    return out


def main() -> None:
    a = parse()
    cuda = torch.cuda.is_available() and not a.small
    if not cuda:
        a.hidden, a.heads, a.kv_heads, a.inter, a.steps, a.rounds = 256, 4, 2, 768, 2, 2
        a.min_len, a.max_len = 60, 120
    dev = "cuda" if cuda else "cpu"
    spec = TinySpec(kind="qwen3", hidden_size=a.hidden, num_layers=1, num_heads=a.heads, num_kv_heads=a.kv_heads,
                    head_dim=a.hidden // a.heads, intermediate_size=a.inter, vocab_size=a.vocab)
    with tempfile.TemporaryDirectory() as tmp:
        target = build_tiny_model(Path(tmp) / "target", spec, device=dev)
        shape = DrafterShape(hidden_size=a.hidden, num_heads=a.heads, num_kv_heads=a.kv_heads,
                             head_dim=a.hidden // a.heads, intermediate_size=a.inter, vocab_size=a.vocab)
        cfg = Eagle3Config(shape=shape, aux_layer_ids=[1, 2, 3], last_layer_id=4, draft_vocab_size=a.vocab,
                           ttt_steps=a.ttt)
        tcfg = TrainConfig(out_dir=str(Path(tmp) / "run"), lr=1e-4, warmup_steps=1, max_steps=10**6,
                           batch_size=a.batch, tensorboard=False, device=dev,
                           dtype="bfloat16" if cuda else "float32")
        tr = Trainer("eagle3", cfg, tcfg, target, torch.arange(a.vocab))
        recs = make_records(a, 4 * a.batch, torch.bfloat16 if cuda else torch.float32)
        aux, last = [1, 2, 3], 4
        groups = [recs[i : i + a.batch] for i in range(0, len(recs), a.batch)]

        def run(variant: str) -> tuple[float, float]:
            """(ms per step, ms of it making the batch), over ``a.steps`` steps."""
            build = 0.0
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for s in range(a.steps):
                b0 = time.perf_counter()
                b = collate(groups[s % len(groups)], aux, last, 4096, None if variant == "host" else tr.device)
                if variant == "host":
                    b = b.to(tr.device)
                build += time.perf_counter() - b0
                tr.train_step(b)  # ends with loss.item(): the device has finished the step
            return (time.perf_counter() - t0) / a.steps * 1e3, build / a.steps * 1e3

        run("device"), run("host")  # warm-up: allocator, kernels
        res: dict[str, list[tuple[float, float]]] = {"host": [], "device": []}
        for r in range(a.rounds):
            for v in (("host", "device") if r % 2 == 0 else ("device", "host")):
                res[v].append(run(v))
        med = {v: statistics.median(x[0] for x in res[v]) for v in res}
        build = {v: statistics.median(x[1] for x in res[v]) for v in res}
        ratios = [h[0] / d[0] for h, d in zip(res["host"], res["device"])]
        name = torch.cuda.get_device_name() if cuda else "cpu"
        print(f"{name}: hidden {a.hidden}, {a.batch} records of {a.min_len}-{a.max_len} tokens a step, "
              f"TTT {a.ttt}, {a.rounds} rounds x {a.steps} steps")
        for v in ("host", "device"):
            print(f"  {v:6s} {med[v]:8.1f} ms/step (batch making {build[v]:6.1f} ms)  "
                  f"rounds {[round(x[0], 1) for x in res[v]]}")
        print(f"  step time host / device: {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}]")
        if a.json:
            a.json.write_text(json.dumps({"device": name, "args": {k: str(v) for k, v in vars(a).items()},
                                          "ms_per_step": med, "batch_ms": build, "rounds": res,
                                          "ratio_host_over_device": statistics.median(ratios)}, indent=1))


if __name__ == "__main__":
    main()
