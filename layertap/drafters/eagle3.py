"""EAGLE-3 drafter (one Llama-style decoder layer) and its training-time-test (TTT) unroll.

Layout matches vLLM's ``llama_eagle3.py`` with ``norm_before_residual = False`` (SafeAILab layout):

    g   = fc(concat(aux states))                        [.., H]     (step 0; later steps: own output)
    x   = cat(input_layernorm(embed(tok)), hidden_norm(g))   [.., 2H]    -> q/k/v are [., 2H]
    r   = g + o_proj(attn(x));  out = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(out))  over the draft vocabulary;   next step is fed ``out`` (pre-norm)

Alignment (speculators / SafeAILab): at index t step j, the token input is x_{t+1+j} (teacher-forced),
the label is the target distribution at row t+1+j (it predicts x_{t+2+j}), and the position is t+j.
Step j's query at t sees step-0 keys at indices <= t plus its own index-t keys of steps 1..j: exactly
the chained KV cache vLLM builds while drafting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from layertap.drafters.common import MLP, RMSNorm, expand_kv, merge_heads, rope, split_heads
from layertap.train.config import Eagle3Config


class Eagle3Attention(nn.Module):
    def __init__(self, in_dim: int, cfg: Eagle3Config):
        super().__init__()
        s = cfg.shape
        self.nh, self.nkv, self.d, self.theta = s.num_heads, s.num_kv_heads, s.head_dim, s.rope_theta
        self.q_proj = nn.Linear(in_dim, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rep = self.nh // self.nkv
        pos = pos.unsqueeze(1)  # [B, T] -> [B, 1, T]: broadcast over heads
        q = rope(split_heads(self.q_proj(x), self.nh, self.d), pos, self.theta)
        k = rope(split_heads(self.k_proj(x), self.nkv, self.d), pos, self.theta)
        v = split_heads(self.v_proj(x), self.nkv, self.d)
        return q, expand_kv(k, rep), expand_kv(v, rep)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Attention of step-j queries over step-0 keys (causal) and steps 1..j keys (own index only).

    All tensors are [B, heads, T, d]; ``keys[0]`` is step 0. The diagonal blocks reduce to one score per
    query, so no [T, T] mask is built for them.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    t = q.shape[-2]
    s0 = (q @ keys[0].transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag = [((q * k).sum(-1, keepdim=True) * scale) for k in keys[1:]]
    probs = torch.softmax(torch.cat([s0, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = probs[..., :t] @ values[0]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., t + i : t + i + 1] * v
    return out


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        s = cfg.shape
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Eagle3Attention(2 * s.hidden_size, cfg)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)


@dataclass
class StepStats:
    """Per unroll step: weighted loss, correct and counted positions (teacher-forced), chain-correct."""

    loss: torch.Tensor
    correct: torch.Tensor
    chain: torch.Tensor
    count: torch.Tensor


def shift_left(x: torch.Tensor, n: int, fill: float | int = 0) -> torch.Tensor:
    """``out[:, t] = x[:, t + n]`` along dim 1, ``fill`` past the end."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor, draft_ids: torch.Tensor):
        super().__init__()
        s = cfg.shape
        if tuple(embed.shape) != (s.vocab_size, s.hidden_size):
            raise ValueError(f"Eagle3Drafter: embedding {tuple(embed.shape)} != ({s.vocab_size}, {s.hidden_size})")
        if draft_ids.numel() != cfg.draft_vocab_size:
            raise ValueError(f"Eagle3Drafter: {draft_ids.numel()} draft ids != draft_vocab_size "
                             f"{cfg.draft_vocab_size}")
        self.cfg = cfg
        # Frozen copy of the target's embedding (SafeAILab load_emb); vLLM shares the target's at serve time.
        self.register_buffer("embed", embed.detach().clone())
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.lm_head = nn.Linear(s.hidden_size, cfg.draft_vocab_size, bias=False)
        ids = draft_ids.to(torch.long).sort().values
        self.register_buffer("draft_ids", ids)  # draft index -> target id, ascending
        self.register_buffer("d2t", ids - torch.arange(ids.numel()))  # offsets, as vLLM adds them back
        t2d = torch.zeros(s.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)

    def step(self, tok: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor, cache: list) -> torch.Tensor:
        """One unroll step; appends this step's K/V to ``cache``; returns the pre-norm output."""
        layer = self.midlayer
        e = layer.input_layernorm(F.embedding(tok, self.embed).to(feat.dtype))
        x = torch.cat([e, layer.hidden_norm(feat)], dim=-1)
        q, k, v = layer.self_attn.qkv(x, pos)
        cache.append((k, v))
        attn = ttt_attention(q, [c[0] for c in cache], [c[1] for c in cache])
        r = feat + layer.self_attn.o_proj(merge_heads(attn))
        return r + layer.mlp(layer.post_attention_layernorm(r))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))

    def forward(self, aux: torch.Tensor, ids: torch.Tensor, target_p: torch.Tensor, target_top: torch.Tensor,
                mask: torch.Tensor) -> list[StepStats]:
        """TTT unroll. ``aux`` [B,T,n*H]; ``ids`` [B,T]; ``target_p`` [B,T,Vd]: target probabilities of
        row t restricted to the draft vocabulary and renormalised; ``target_top`` [B,T]: the target's
        argmax (target ids) at row t; ``mask`` [B,T] 0/1: token t is a trained (assistant) token."""
        b, t = ids.shape
        base = torch.arange(t, device=ids.device).expand(b, t)
        in_vocab = self.t2d[target_top]  # positions whose target token the drafter cannot emit are skipped
        feat, cache, stats = self.fc(aux), [], []
        chain = torch.ones_like(mask, dtype=torch.bool)
        for j in range(self.cfg.ttt_steps):
            out = self.step(shift_left(ids, 1 + j), feat, base + j, cache)
            logq = torch.log_softmax(self.logits(out).float(), dim=-1)
            p = shift_left(target_p, 1 + j)
            w = (shift_left(mask, 2 + j) * shift_left(in_vocab, 1 + j, False)).float()
            # Forward KL(p || q): same gradient as -sum p log q, but 0 at a perfect fit, so the logged
            # loss is comparable across targets (a soft target's entropy is not a floor we report).
            loss = (torch.special.xlogy(p, p) - p * logq).sum(-1)
            hit = self.draft_ids[logq.argmax(-1)] == shift_left(target_top, 1 + j, -1)
            chain = chain & hit
            stats.append(StepStats(
                loss=(loss * w).sum() / w.sum().clamp(min=1.0),
                correct=(hit.float() * w).sum().detach(),
                chain=(chain.float() * w).sum().detach(),
                count=w.sum().detach(),
            ))
            feat = out
        return stats


def draft_vocab_from_counts(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target ids (ties broken by lower id), sorted ascending."""
    if size > counts.numel():
        raise ValueError(f"draft vocab size {size} exceeds target vocab {counts.numel()}")
    # Stable sort on -count keeps equal-count ids in id order: deterministic across runs.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    return order[:size].sort().values
