"""Compact storage: drop rows nobody trains on and narrow the dtype, before a record is put.

``compact(tensors, meta, only_loss_masked=..., dtype=...)`` is a pure function applied by the connector
to a record's tensors before ``Sink.put``; its options travel in the transport config as
``config["compact"] = {"only_loss_masked": bool, "dtype": "fp32" | "fp16" | "bf16" | "fp8"}``.

Rows kept with ``only_loss_masked``: every row whose token is loss-masked (an assistant token) *and* the
row just before each masked span, because row ``t`` is the state that predicts token ``t + 1``: a drafter
learning the first assistant token needs the last prompt row. The kept row indices go in a
``positions`` int64 tensor; ``token_ids`` and ``loss_mask`` stay whole, so the token digest and
``Record.check()`` (which validates ``positions``) still hold.

dtypes: ``fp16``/``bf16`` are plain casts (fp16 overflows above 65504: such a record raises rather than
storing inf). ``fp8`` is e4m3 (max 448) with one fp32 scale per record, ``scale = amax / 448``, stored as
the 0-d tensor ``hidden_scale``; ``records.to_record`` dequantizes ``fp8 * scale`` back to fp32.
"""

from __future__ import annotations

from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP16_MAX = 65504.0


def kept_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Row indices (int64, increasing) of masked tokens plus the row before each masked span."""
    m = loss_mask.to(torch.bool).flatten()
    keep = m.clone()
    keep[:-1] |= m[1:]  # row t predicts token t + 1
    return keep.nonzero().flatten().to(torch.int64)


def quantize_fp8(hs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``q.float() * scale ~= hs``; scale is a 0-d fp32 tensor (1.0 for all zeros)."""
    amax = hs.detach().abs().max().to(torch.float32) if hs.numel() else torch.tensor(0.0)
    scale = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
    q = (hs.to(torch.float32) / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(())


def compact(tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, only_loss_masked: bool = False,
            dtype: str = "fp32") -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return new ``(tensors, meta)``; inputs are not modified. Raises ``ValueError`` naming the record."""
    name = meta.get("key", meta.get("index"))
    if dtype not in DTYPES:
        raise ValueError(f"record {name}: compact dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out = dict(tensors)
    hs = tensors["hidden_states"]
    if not torch.isfinite(hs).all():
        raise ValueError(f"record {name}: hidden_states hold inf/nan; refusing to store them compacted")
    if only_loss_masked:
        if "loss_mask" not in tensors:
            raise ValueError(f"record {name}: only_loss_masked needs a loss_mask (conversation input)")
        if "positions" in tensors:
            raise ValueError(f"record {name}: already compacted (has positions)")
        pos = kept_rows(tensors["loss_mask"])
        out["positions"] = pos
        hs = hs.index_select(0, pos)
    if dtype == "fp8":
        hs, out["hidden_scale"] = quantize_fp8(hs)
    else:
        if dtype == "fp16" and hs.numel() and float(hs.abs().max()) > FP16_MAX:
            raise ValueError(f"record {name}: |hidden| exceeds the fp16 range {FP16_MAX}; use bf16 or fp8")
        hs = hs.to(DTYPES[dtype])
    out["hidden_states"] = hs.contiguous()
    new_meta = {**meta, "compact": {"only_loss_masked": only_loss_masked, "dtype": dtype}}
    return out, new_meta


def compact_from_config(tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                        config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Apply ``config["compact"]`` if present (the connector's one-liner); identity otherwise."""
    opts = config.get("compact")
    if not opts:
        return tensors, meta
    return compact(tensors, meta, only_loss_masked=bool(opts.get("only_loss_masked", False)),
                   dtype=str(opts.get("dtype", "fp32")))
