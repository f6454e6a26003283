"""Train a small Qwen3 target on the Python standard library's source, so drafters have something real
to learn. Random-weight targets make acceptance meaningless: their next-token distribution carries no
structure a drafter could exploit beyond what an n-gram matcher finds.

The corpus is what ``layertap.data_files/sample_convs.jsonl`` looks like: chat-formatted "continue this
code" turns cut from stdlib files, rendered with the tiny tokenizer's ChatML template. The target thus
learns both Python and the turn structure (it stops with ``<|im_end|>``), and its greedy continuations of
held-out prompts are code, not loops of one token.

Everything is deterministic in ``TargetSpec.seed`` and cached under ``default_cache_dir()`` keyed by a hash
of the spec: the first call trains (a few minutes on 2 CPU cores), later calls reuse the checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from layertap.models.tiny import (
    TinySpec,
    corpus_files,
    build_tokenizer,
    default_cache_dir,
    hf_config,
    spec_hash,
)

USER_TEMPLATES = (
    "Write the next lines:\n",
    "Continue this Python code:\n",
    "Complete the code:\n",
    "What comes next in this file?\n",
)


@dataclass(frozen=True, kw_only=True)
class TargetSpec:
    """Shape and training budget of the trained target."""

    model: TinySpec = TinySpec(kind="qwen3", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                               head_dim=64, intermediate_size=768, vocab_size=2048)
    """Architecture; head_dim 64 so the same checkpoint also runs under GPU FlashAttention."""
    steps: int = 320
    """Optimizer steps: ~3.5 min on 2 idle CPU cores (0.66 s/step at the default batch); 13 min were
    measured with two other vLLM engines sharing those cores. Final loss ~3.2 nats/token."""
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 40
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "warmup"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TargetSpec.{name} must be > 0, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"TargetSpec.lr must be > 0, got {self.lr}")


def _spec_key(spec: TargetSpec) -> str:
    d = asdict(spec)
    d["model"] = spec_hash(spec.model)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def chat_conversations(n: int, seed: int, *, max_lines: int = 12) -> list[list[dict[str, str]]]:
    """``n`` "continue this code" conversations cut from stdlib files, deterministic in ``seed``."""
    rng = random.Random(seed)
    files = [Path(p).read_text(encoding="utf-8", errors="replace").splitlines() for p in corpus_files()]
    files = [f for f in files if len(f) > 2 * max_lines]
    out = []
    for _ in range(n):
        lines = rng.choice(files)
        a = rng.randint(2, max_lines)
        b = rng.randint(2, max_lines)
        start = rng.randrange(0, len(lines) - a - b)
        out.append([
            {"role": "user", "content": rng.choice(USER_TEMPLATES) + "\n".join(lines[start:start + a])},
            {"role": "assistant", "content": "\n".join(lines[start + a:start + a + b])},
        ])
    return out


def chat_examples(n: int, seed: int, tokenizer, *, max_lines: int = 12) -> list[list[int]]:
    """Token ids of ``chat_conversations`` rendered with the chat template."""
    out = []
    for msgs in chat_conversations(n, seed, max_lines=max_lines):
        ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def write_conversations(path: str | Path, n: int, seed: int) -> Path:
    """Write ``n`` conversations as ``{"messages": ...}`` JSONL: prompts for drafter data (use a seed other
    than the target's training seed, 0, to get prompts the target never saw verbatim)."""
    p = Path(path)
    with open(p, "w", encoding="utf-8") as f:
        for msgs in chat_conversations(n, seed):
            f.write(json.dumps({"messages": msgs}) + "\n")
    return p


def _pack(examples: list[list[int]], seq_len: int, pad_id: int):
    """Concatenate examples into rows of ``seq_len`` (documents may cross rows, like GPT pretraining)."""
    import torch

    flat = [t for ex in examples for t in ex]
    n_rows = len(flat) // seq_len
    if n_rows == 0:
        raise ValueError(f"corpus of {len(flat)} tokens is shorter than seq_len={seq_len}")
    return torch.tensor(flat[: n_rows * seq_len], dtype=torch.long).view(n_rows, seq_len)


def _lr_at(step: int, spec: TargetSpec) -> float:
    # Linear warmup then cosine to 10%: the usual small-LM schedule, robust at this high peak LR.
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    frac = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


TRAIN_DTYPES = ("float32", "bfloat16")


def train_target(out_dir: str | Path, spec: TargetSpec | None = None, *, log_every: int = 50,
                 device: str = "cpu", dtype: str = "float32", time_budget_s: float | None = None) -> Path:
    """Train the target into ``out_dir`` (tokenizer + safetensors + config); returns the path.

    ``device`` and ``dtype`` say where and how it trains; the defaults are the fp32 CPU run that made the
    cached CPU target. ``dtype="bfloat16"`` trains under bf16 autocast (fp32 master weights and optimizer
    state) and saves bf16 weights, so vLLM serves the checkpoint in bf16 by default. ``time_budget_s`` ends
    training after that many seconds even if ``spec.steps`` are not done (the stamp records the steps
    done). None of the three is part of the cache key: they change how fast the spec is trained, not what.
    """
    import torch
    from transformers import Qwen3ForCausalLM

    spec = spec or TargetSpec()
    if dtype not in TRAIN_DTYPES:
        raise ValueError(f"train_target: dtype must be one of {TRAIN_DTYPES}, got {dtype!r}")
    dev = torch.device(device)
    torch.set_num_threads(min(2, torch.get_num_threads()))  # the CPU machines are shared
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, spec.model.vocab_size)
    torch.manual_seed(spec.seed)
    # On an accelerator the weights are initialised there (seconds instead of a minute for 1 B parameters).
    with dev if dev.type != "cpu" else contextlib.nullcontext():
        model = Qwen3ForCausalLM(hf_config(spec.model, tokenizer)).to(torch.float32).to(dev)
    n_tokens = spec.steps * spec.batch_size * spec.seq_len
    # ~170 tokens per example; 1.3x headroom so no row is seen twice within the budget.
    data = _pack(chat_examples(int(1.3 * n_tokens / 170) + 64, spec.seed, tokenizer), spec.seq_len,
                 tokenizer.pad_token_id)
    gen = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(data.shape[0], generator=gen)
    cuda = dev.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
    model.train()
    losses = []  # detached per-step losses; read back once at the end (no sync per step)
    t0 = time.monotonic()
    for step in range(spec.steps):
        idx = order[(torch.arange(spec.batch_size) + step * spec.batch_size) % data.shape[0]]
        batch = data[idx].to(dev)
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, spec)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
            loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.detach())
        last = step == spec.steps - 1
        over = time_budget_s is not None and time.monotonic() - t0 > time_budget_s
        if log_every and (step % log_every == 0 or last or over):
            print(f"[train_target] step {step}/{spec.steps} loss {loss.item():.3f} "
                  f"({time.monotonic() - t0:.0f}s)", flush=True)
        if over and not last:
            print(f"[train_target] time budget {time_budget_s:.0f}s reached after {step + 1} of {spec.steps} steps",
                  flush=True)
            break
    train_s = time.monotonic() - t0
    model.eval()
    if dtype == "bfloat16":
        model.to(torch.bfloat16)  # save_pretrained records the weights' dtype in config.json
    model.to("cpu").save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    curve = [round(float(x), 4) for x in torch.stack(losses).float().cpu()]
    (out / "layertap_target.json").write_text(json.dumps(
        {"hash": _spec_key(spec), "final_loss": float(loss.item()), "steps": spec.steps, "steps_done": len(curve),
         "device": str(dev), "dtype": dtype, "train_s": round(train_s, 1), "losses": curve}, indent=1))
    return out


def trained_target(spec: TargetSpec | None = None, **train_kw: Any) -> Path:
    """Path of the cached trained target for ``spec`` (trained on first use, then reused); ``train_kw``
    (``device``, ``dtype``, ``time_budget_s``, ``log_every``) go to ``train_target`` when it trains."""
    spec = spec or TargetSpec()
    out = default_cache_dir() / f"target-qwen3-{_spec_key(spec)}"
    stamp = out / "layertap_target.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("hash") == _spec_key(spec):
        return out
    return train_target(out, spec, **train_kw)


if __name__ == "__main__":
    print(trained_target())
