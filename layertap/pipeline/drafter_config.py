"""A drafter's config (EAGLE-3 or DFlash) from the target checkpoint and the captured layer ids.

``layertap train`` (``build.new_trainer``) and ``layertap train-offline`` both build their drafter here;
each keyword's default is what ``train-offline --help`` documents for its flag.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layertap.train.config import DFlashConfig, DrafterShape, Eagle3Config


def _config(target: str | Path) -> dict[str, Any]:
    return json.loads((Path(target) / "config.json").read_text())


def drafter_shape(target: str | Path) -> DrafterShape:
    """The draft transformer's shape for ``target``: its hidden size, heads and vocabulary (``config.json``)."""
    c = _config(target)
    theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return DrafterShape(hidden_size=c["hidden_size"], num_heads=c["num_attention_heads"],
                        num_kv_heads=c["num_key_value_heads"],
                        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
                        intermediate_size=c["intermediate_size"], vocab_size=c["vocab_size"],
                        rms_norm_eps=c.get("rms_norm_eps", 1e-6), rope_theta=float(theta))


def default_draft_vocab(vocab_size: int) -> int:
    """EAGLE-3 draft vocabulary: 32000 for a large vocabulary, half of a tiny one."""
    return min(vocab_size, 32000 if vocab_size > 64000 else vocab_size // 2)


def drafter_config(kind: str, target: str | Path, captured: list[int], *, draft_vocab: int | None = None,
                   aux_layers: list[int] | None = None, last_layer: int | None = None, ttt_steps: int = 3,
                   target_layer_ids: list[int] | None = None, dflash_layers: int = 2, block_size: int = 8,
                   anchors: int = 64) -> Eagle3Config | DFlashConfig:
    """The config of a ``kind`` ("eagle3" | "dflash") drafter of ``target`` trained on records of the
    ``captured`` layer ids. Defaults: EAGLE-3 reads the captured ids below the last layer as aux ids and the
    pre-norm last state (id ``num_hidden_layers``) as its labels; DFlash uses the same states, as DFlash ids
    (output of layer k = aux id k + 1). ``ValueError`` where DFlash's tokenizer has no ``<|mask|>`` token."""
    shape, n = drafter_shape(target), int(_config(target)["num_hidden_layers"])
    below = [i for i in captured if i < n]
    if kind == "eagle3":
        return Eagle3Config(shape=shape, aux_layer_ids=aux_layers or below,
                            last_layer_id=n if last_layer is None else last_layer,
                            draft_vocab_size=draft_vocab or default_draft_vocab(shape.vocab_size), ttt_steps=ttt_steps)
    if kind != "dflash":
        raise ValueError(f"drafter kind must be eagle3 or dflash, got {kind!r}")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    mask = tok.convert_tokens_to_ids("<|mask|>")
    if mask is None or mask == tok.unk_token_id:
        raise ValueError(f"the tokenizer of {target} has no <|mask|> token for DFlash")
    return DFlashConfig(shape=shape, target_layer_ids=target_layer_ids or [i - 1 for i in below if i > 0],
                        num_layers=dflash_layers, block_size=block_size, mask_token_id=mask,
                        anchors_per_seq=anchors)
