"""DFlash block drafter (arXiv 2602.06036), laid out as vLLM's ``qwen3_dflash.py`` serves it.

    c      = hidden_norm(fc(concat target states))          context feature, one per target position
    block  = [anchor token, MASK x (B-1)] at positions a .. a+B-1;   h = embed(block)
    layer  : Q from input_layernorm(h) (q_norm, RoPE);  K/V = [k/v_proj(c) | k/v_proj(input_layernorm(h))]
             (k_norm + RoPE on both; c skips input_layernorm, as vLLM's precompute_and_store_context_kv)
             queries see context positions < a (strictly before the anchor) and the whole block (non-causal)
    logits = target lm_head(norm(h_out));   slot j predicts the token AT position a+j (no shift)

Loss: cross-entropy on slots 1..B-1 against the sequence tokens (the target's own greedy output in
regenerate mode), weighted exp(-(j-1)/gamma). SpecForge #473's two bugs (shifted labels, a context that
includes the anchor) are exactly what the alignment above rules out; tests pin both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from layertap.drafters.common import MLP, RMSNorm, rope
from layertap.drafters.eagle3 import StepStats
from layertap.train.config import DFlashConfig


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        s = cfg.shape
        self.nh, self.nkv, self.d, self.theta = s.num_heads, s.num_kv_heads, s.head_dim, s.rope_theta
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """[..., T, n*d] -> [..., n, T, d]."""
        return x.unflatten(-1, (n, self.d)).transpose(-2, -3)

    def kv(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rep = self.nh // self.nkv
        k = rope(self.k_norm(self._heads(self.k_proj(x), self.nkv)), pos.unsqueeze(-2), self.theta)
        v = self._heads(self.v_proj(x), self.nkv)
        return k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                ctx_visible: torch.Tensor) -> torch.Tensor:
        """``x`` [B,A,K,H] block states; ``ctx_k/v`` [B,1,nh,T,d]; ``ctx_visible`` [B,A,1,1,T] bool."""
        q = rope(self.q_norm(self._heads(self.q_proj(x), self.nh)), pos.unsqueeze(-2), self.theta)
        k, v = self.kv(x, pos)
        scale = 1.0 / math.sqrt(self.d)
        s_ctx = (q @ ctx_k.transpose(-1, -2) * scale).masked_fill(~ctx_visible, float("-inf"))
        s_blk = q @ k.transpose(-1, -2) * scale  # bidirectional inside the block
        p = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(q.dtype)
        t = ctx_k.shape[-2]
        out = p[..., :t] @ ctx_v + p[..., t:] @ v  # [B,A,nh,K,d]
        return self.o_proj(out.transpose(-2, -3).flatten(-2))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        s = cfg.shape
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 final_norm: torch.Tensor | None = None):
        super().__init__()
        s = cfg.shape
        for name, w in (("embed", embed), ("lm_head", lm_head)):
            if tuple(w.shape) != (s.vocab_size, s.hidden_size):
                raise ValueError(f"DFlashDrafter: {name} {tuple(w.shape)} != ({s.vocab_size}, {s.hidden_size})")
        self.cfg = cfg
        # Target embedding and lm_head are frozen and not exported: vLLM shares the target's copies.
        self.register_buffer("embed", embed.detach().clone())
        self.register_buffer("target_lm_head", lm_head.detach().clone())
        self.fc = nn.Linear(len(cfg.target_layer_ids) * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        if final_norm is not None:
            # The frozen target lm_head expects states scaled by the target's final norm: start there,
            # instead of at gain 1, which on trained targets gives near-uniform logits at step 0.
            self.norm.weight.data.copy_(final_norm)

    def block_logits(self, aux: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Logits [B,A,K,V] for blocks anchored at ``anchors`` [B,A] (>= 1; invalid entries clamped)."""
        bsz, t = ids.shape
        k_blk = self.cfg.block_size
        a = anchors.clamp(min=1)
        c = self.hidden_norm(self.fc(aux))  # [B,T,H]
        slot = torch.arange(k_blk, device=ids.device)
        pos = a.unsqueeze(-1) + slot  # [B,A,K]
        toks = torch.full_like(pos, self.cfg.mask_token_id)
        toks[..., 0] = torch.gather(ids, 1, a)
        h = F.embedding(toks, self.embed).to(aux.dtype)
        ctx_pos = torch.arange(t, device=ids.device).expand(bsz, t)
        ctx_visible = (ctx_pos.unsqueeze(1) < a.unsqueeze(-1))[:, :, None, None, :]  # strictly before anchor
        res = None
        for layer in self.layers:
            res = h if res is None else res + h
            x = layer.input_layernorm(res)
            ck, cv = layer.self_attn.kv(c, ctx_pos)
            res = res + layer.self_attn(x, pos, ck.unsqueeze(1), cv.unsqueeze(1), ctx_visible)
            h = layer.mlp(layer.post_attention_layernorm(res))
        out = self.norm(res + h)
        return out @ self.target_lm_head.to(out.dtype).T

    def forward(self, aux: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor,
                anchors: torch.Tensor) -> list[StepStats]:
        """Per-slot stats for slots 1..B-1; ``anchors`` [B,A] with -1 for unused entries."""
        logits = self.block_logits(aux, ids, anchors)
        k_blk = self.cfg.block_size
        lab_pos = anchors.clamp(min=0).unsqueeze(-1) + torch.arange(k_blk, device=ids.device)
        ok = (anchors.unsqueeze(-1) >= 1) & (lab_pos < lengths.view(-1, 1, 1))
        lab_pos = lab_pos.clamp(max=ids.shape[1] - 1)
        labels = torch.gather(ids.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, lab_pos)
        lm = torch.gather(mask.unsqueeze(1).expand(-1, anchors.shape[1], -1), 2, lab_pos)
        w_all = (ok & (lm > 0)).float()
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll = -torch.gather(logp, -1, labels.unsqueeze(-1)).squeeze(-1)
        hit = logp.argmax(-1) == labels
        stats, chain = [], torch.ones_like(hit[..., 0])
        for j in range(1, k_blk):
            w = w_all[..., j]
            chain = chain & hit[..., j]
            decay = math.exp(-(j - 1) / self.cfg.gamma)
            stats.append(StepStats(
                loss=decay * (nll[..., j] * w).sum() / w.sum().clamp(min=1.0),
                correct=(hit[..., j].float() * w).sum().detach(),
                chain=(chain.float() * w).sum().detach(),
                count=w.sum().detach(),
            ))
        return stats


def sample_anchors(mask: torch.Tensor, lengths: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """Up to ``n`` anchors per row, drawn without replacement from positions a in [1, len-2] whose next
    token is trained (``mask[a+1]``); [B, n] sorted, -1 where a row has fewer candidates."""
    bsz, t = mask.shape
    out = torch.full((bsz, n), -1, dtype=torch.long)
    host_mask, host_len = mask.cpu(), lengths.tolist()  # one copy each, not one per row
    for b in range(bsz):
        cand = torch.nonzero(host_mask[b, 2 : int(host_len[b])] > 0).flatten() + 1
        if cand.numel() == 0:
            continue
        pick = cand[torch.randperm(cand.numel(), generator=gen)[:n]].sort().values
        out[b, : pick.numel()] = pick
    return out.to(mask.device)
