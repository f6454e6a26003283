"""Pieces both drafters share: RMSNorm, neox RoPE, SwiGLU MLP, GQA expansion, masked softmax attention.

Weights are named as vLLM's loaders expect (``q_proj``, ``gate_proj``, ...), so export is a rename-free
``state_dict`` filter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layertap.models.head import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (halves rotated), vLLM's default layout for Llama/Qwen3.

    ``x`` is [..., T, head_dim] and ``pos`` broadcasts against [..., T]. Angles are computed in fp32:
    positions in the thousands times bf16 frequencies would lose the low bits that RoPE encodes.
    """
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32).unsqueeze(-1) * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def expand_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, kv_heads, T, d] -> [B, kv_heads * n_rep, T, d] (grouped-query attention)."""
    return k if n_rep == 1 else k.repeat_interleave(n_rep, dim=1)


def split_heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """[B, T, n*d] -> [B, n, T, d]."""
    b, t, _ = x.shape
    return x.view(b, t, n, d).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, n, T, d] -> [B, T, n*d]."""
    b, n, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, n * d)
