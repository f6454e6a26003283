"""The target's output head (final RMSNorm + ``lm_head``), read straight from its safetensors files.

Captured states are *pre-norm* (layer id ``N``), so target logits are ``lm_head(final_norm(h_N))``.
Dropping the norm is a known silent bug (speculators PR #313): the argmax often survives, the soft
distribution does not. ``agreement`` is the self-test: on greedily generated tokens, the argmax of
this head on captured states must reproduce the target's own next tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, via the index when the checkpoint is sharded."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: model_dir / v for k, v in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"no model.safetensors(.index.json) under {model_dir}")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def load_tensors(model_dir: str | Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Load only ``names`` from a checkpoint (no full model load); raises KeyError naming the missing one."""
    from safetensors import safe_open

    files = _tensor_files(Path(model_dir))
    out = {}
    for n in names:
        if n not in files:
            raise KeyError(f"tensor {n!r} not found in {model_dir}")
        with safe_open(str(files[n]), "pt") as f:
            out[n] = f.get_tensor(n)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 variance, as HF and vLLM compute it: bf16 squares lose ~3 digits on 4096-wide states.
    var = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(var + eps)).to(x.dtype) * weight


class TargetHead(nn.Module):
    """Frozen final norm + lm_head of a target; ``forward(h_prenorm) -> logits``."""

    def __init__(self, norm_weight: torch.Tensor, lm_head: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.detach().clone())
        self.register_buffer("lm_head", lm_head.detach().clone())
        self.eps = eps

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "TargetHead":
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        head_name = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
        t = load_tensors(model_dir, ["model.norm.weight", head_name])
        return cls(t["model.norm.weight"], t[head_name], float(cfg.get("rms_norm_eps", 1e-6)))

    @property
    def hidden_size(self) -> int:
        return int(self.lm_head.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.shape[0])

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        """The "verifier norm": the target's final RMSNorm applied to pre-norm state ``h``."""
        return rms_norm(h, self.norm_weight.to(h.dtype), self.eps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[-1] != self.hidden_size:
            raise ValueError(f"TargetHead: state width {h.shape[-1]} != hidden size {self.hidden_size}")
        return self.normed(h) @ self.lm_head.to(h.dtype).T


def agreement(head: TargetHead, last_states: torch.Tensor, token_ids: torch.Tensor, start: int,
              near_tie: float = 0.0) -> float:
    """Share of rows ``t >= start`` whose head argmax equals ``token_ids[t + 1]``.

    On a greedily generated span this is ~1.0 (ties aside); on teacher-forced text it is the
    target's accuracy, well below 1. ``last_states`` are the pre-norm id-``N`` rows.

    ``near_tie``: a row also agrees where the head's logit of ``token_ids[t + 1]`` lies within ``near_tie``
    of its best logit, relative to that logit's size (at least 1). An engine running in bf16 rounds its
    weights, its norm and its logits to 8 significant bits and takes the argmax of those: where two logits
    are that close, its choice and this float32 head's can differ with both right.
    """
    n = int(token_ids.shape[0])
    if not 0 <= start < n - 1:
        raise ValueError(f"agreement: start={start} must lie in [0, {n - 1}) for {n} tokens")
    states, want = last_states[start : n - 1], token_ids[start + 1 : n]
    pred, best = greedy_argmax(head, states, values=True)
    ok = pred == want
    if near_tie > 0 and not bool(ok.all()):
        dev = head.lm_head.device
        with torch.no_grad():
            x = head.normed(states.to(dev, torch.float32))
            mine = (x * head.lm_head[want.to(dev)].to(torch.float32)).sum(-1).cpu()
        ok |= best - mine <= near_tie * best.abs().clamp_min(1.0)
    return float(ok.float().mean())


ARGMAX_CHUNK = 16384
"""Vocabulary rows per float32 slice in ``greedy_argmax``: 256 MiB at hidden 4096."""


def greedy_argmax(head: TargetHead, last_states: torch.Tensor, values: bool = False) -> Any:
    """The head's argmax per row in float32, on the head's device, one vocabulary slice at a time (no
    float32 copy of a large head beside the engine); ties go to the lowest id, as ``torch.argmax``. Returns
    ids on the CPU (``values``: and the best logits, float32, on the CPU)."""
    if last_states.shape[-1] != head.hidden_size:
        raise ValueError(f"TargetHead: state width {last_states.shape[-1]} != hidden size {head.hidden_size}")
    dev = head.lm_head.device
    with torch.no_grad():
        x = head.normed(last_states.to(dev, torch.float32))
        best = torch.full((x.shape[0],), float("-inf"), device=dev)
        arg = torch.zeros(x.shape[0], dtype=torch.long, device=dev)
        for i in range(0, head.vocab_size, ARGMAX_CHUNK):
            val, idx = (x @ head.lm_head[i : i + ARGMAX_CHUNK].to(torch.float32).T).max(-1)
            better = val > best
            best = torch.where(better, val, best)
            arg = torch.where(better, idx + i, arg)
    return (arg.cpu(), best.cpu()) if values else arg.cpu()
