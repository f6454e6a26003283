"""Export trained drafters to directories vLLM 0.32 loads.

Formats (``fmt``):
    ``legacy``      EAGLE-3 HF layout, ``LlamaForCausalLMEagle3``; weights ``midlayer.*``; serve with
                    ``speculative_config={"method": "eagle3", "model": dir}``.
    ``speculators`` EAGLE-3 or DFlash in vllm-project/speculators layout (no top-level ``model_type``:
                    vLLM detects the format by its absence plus ``speculators_config``); EAGLE-3 weights
                    ``layers.0.*``, as speculators' own ``Eagle3DraftModel`` names them. Checked by loading
                    with speculators 0.9.0 in tests/unit/test_speculators.py.
    ``zlab``        DFlash in z-lab layout (``DFlashDraftModel``, ``dflash_config``).

Id conventions written out: EAGLE-3 ``eagle_aux_hidden_state_layer_ids`` are vLLM aux ids (input of layer
i); DFlash ``dflash_config.target_layer_ids`` are outputs of layer k (= aux id - 1), while speculators'
``aux_hidden_state_layer_ids`` are aux ids (vLLM subtracts one). Every norm flag is written explicitly:
vLLM's legacy and speculators loaders default ``norm_before_residual`` differently.

The target's embedding and lm_head are not exported (vLLM shares the target's copies when absent), except
the embedding in speculators-format EAGLE-3, which speculators needs (see ``eagle3_weights``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from layertap.train.config import DFlashConfig, DrafterShape, Eagle3Config

FORMATS = {"eagle3": ("legacy", "speculators"), "dflash": ("zlab", "speculators")}


def _layer_config(shape: DrafterShape, model_type: str, num_layers: int) -> dict[str, Any]:
    return {
        "model_type": model_type, "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "num_hidden_layers": num_layers, "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "max_position_embeddings": shape.max_position_embeddings, "vocab_size": shape.vocab_size,
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
        "torch_dtype": "float32",
    }


def _eagle3_flags(cfg: Eagle3Config) -> dict[str, Any]:
    # Our layer is the SafeAILab layout: residual = raw fc output, no extra norms, pre-norm feedback.
    return {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.shape.hidden_size,
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}


def eagle3_weights(sd: dict[str, torch.Tensor], fmt: str = "legacy") -> dict[str, torch.Tensor]:
    out = {k: v for k, v in sd.items() if k.startswith(("fc.", "midlayer.", "norm.", "lm_head."))}
    if fmt == "speculators":
        # speculators names the decoder layer ``layers.0`` (its legacy converter renames ``midlayer.``); it
        # loads ``midlayer.*`` as unexpected keys and leaves layer 0 at its random init. vLLM maps
        # ``midlayer.`` to ``layers.0.`` itself, so it loads either name.
        out = {"layers.0." + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k: v
               for k, v in out.items()}
        # speculators saves EAGLE-3's embedding and relies on it when loading: 0.9.0 under transformers 5
        # leaves an absent ``embed_tokens.weight`` as uninitialised memory (its NaN "not loaded" marker is
        # lost), so the drafter it builds embeds tokens with garbage. The copy is the target's (the drafter
        # trains it frozen); vLLM finds it identical to the target's and shares the target's.
        out["embed_tokens.weight"] = sd["embed"]
    out["d2t"] = sd["d2t"].to(torch.int64)
    out["t2d"] = sd["t2d"].to(torch.bool)
    return out


def dflash_weights(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if k.startswith(("fc.", "hidden_norm.", "layers.", "norm."))}


def _verifier_architectures(target: str) -> list[str]:
    """The target's ``architectures`` as its config.json lists them (what speculators' ``VerifierConfig``
    records); [] where that file cannot be read, as speculators records then."""
    try:
        return list(json.loads((Path(target) / "config.json").read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return []


def _spec_block(kind: str, k: int, target: str) -> dict[str, Any]:
    return {"algorithm": kind, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k}],
            "verifier": {"name_or_path": target, "architectures": _verifier_architectures(target)}}


def eagle3_config(cfg: Eagle3Config, fmt: str, target: str, num_spec: int) -> dict[str, Any]:
    layer = _layer_config(cfg.shape, "llama", 1)
    if fmt == "legacy":
        flags = _eagle3_flags(cfg)
        eagle = {"use_aux_hidden_state": True,
                 "eagle_aux_hidden_state_layer_ids": flags["eagle_aux_hidden_state_layer_ids"]}
        return {**layer, "architectures": ["LlamaForCausalLMEagle3"], **flags, "eagle_config": eagle}
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": layer, **_eagle3_flags(cfg),
            "speculators_config": _spec_block("eagle3", num_spec, target)}


def dflash_config(cfg: DFlashConfig, fmt: str, target: str) -> dict[str, Any]:
    layer = _layer_config(cfg.shape, "qwen3", cfg.num_layers)
    if fmt == "zlab":
        return {**layer, "architectures": ["DFlashDraftModel"], "block_size": cfg.block_size,
                "dflash_config": {"mask_token_id": cfg.mask_token_id,
                                  "target_layer_ids": list(cfg.target_layer_ids)}}
    # sliding_window_non_causal is deliberately absent: vLLM reads it as causal = not value (default
    # non-causal); speculators' serialized false would make every layer causal (drafters-notes gotcha 7).
    return {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
            "transformer_layer_config": layer, "draft_vocab_size": cfg.shape.vocab_size,
            "target_hidden_size": cfg.shape.hidden_size, "mask_token_id": cfg.mask_token_id,
            "aux_hidden_state_layer_ids": cfg.aux_layer_ids, "block_size": cfg.block_size,
            "sample_from_anchor": False,
            "speculators_config": _spec_block("dflash", cfg.block_size - 1, target)}


def export(checkpoint: str | Path, out_dir: str | Path, fmt: str | None = None, *, num_spec: int = 3,
           dtype: torch.dtype = torch.float32) -> Path:
    """Write ``out_dir`` (config.json + model.safetensors) from a trainer checkpoint; returns it."""
    from safetensors.torch import save_file

    from layertap.train.trainer import config_from_dict

    sd = torch.load(checkpoint, map_location="cpu", weights_only=False)
    kind = sd["kind"]
    fmt = fmt or FORMATS[kind][0]
    if fmt not in FORMATS[kind]:
        raise ValueError(f"export: format {fmt!r} is not one of {FORMATS[kind]} for a {kind} drafter")
    cfg = config_from_dict(kind, sd["config"])
    target = sd["target"]
    if kind == "eagle3":
        conf, weights = eagle3_config(cfg, fmt, target, num_spec), eagle3_weights(sd["model"], fmt)
    else:
        conf, weights = dflash_config(cfg, fmt, target), dflash_weights(sd["model"])
    weights = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in weights.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conf["torch_dtype"] = str(dtype).removeprefix("torch.")
    conf["layertap"] = {"kind": kind, "format": fmt, "target": target, "step": sd["step"],
                        "aux_layer_ids": cfg.aux_layer_ids}
    (out / "config.json").write_text(json.dumps(conf, indent=1))
    save_file(weights, str(out / "model.safetensors"))
    return out


def speculative_config(drafter_dir: str | Path, num_spec: int | None = None) -> dict[str, Any]:
    """The ``speculative_config`` dict that serves ``drafter_dir``; DFlash defaults to B-1 tokens."""
    conf = json.loads((Path(drafter_dir) / "config.json").read_text())
    kind = conf["layertap"]["kind"]
    if num_spec is None:
        num_spec = conf.get("block_size", 4) - 1 if kind == "dflash" else 3
    return {"method": kind, "model": str(drafter_dir), "num_speculative_tokens": int(num_spec)}
