"""What layertap needs to know about a target checkpoint, read without loading the model."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch


class TargetError(ValueError):
    """The target model path or a setting derived from it is wrong; the message names it."""


@dataclass
class TargetInfo:
    path: Path
    config: dict
    config_hash: str

    @classmethod
    def load(cls, model: str | os.PathLike) -> "TargetInfo":
        path = Path(model).expanduser()
        cfg = path / "config.json"
        if not path.is_dir() or not cfg.exists():
            raise TargetError(
                f"unknown model {str(model)!r}: no local directory with a config.json there "
                "(layertap loads local checkpoints saved with save_pretrained; there is no hub access)"
            )
        raw = cfg.read_bytes()
        config = json.loads(raw)
        config = config.get("text_config", config) if "num_hidden_layers" not in config else config
        for key in ("num_hidden_layers", "hidden_size"):
            if key not in config:
                raise TargetError(f"model {path}: config.json has no {key!r} (model_type={config.get('model_type')!r})")
        return cls(path.resolve(), config, hashlib.sha256(raw).hexdigest()[:16])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    def check_layer_ids(self, layers) -> list[int]:
        """Validated layer ids in ascending order (vLLM stores planes ascending)."""
        try:
            ids = [int(i) for i in layers]
        except (TypeError, ValueError):
            raise TargetError(f"layer ids must be integers, got {layers!r}") from None
        if not ids:
            raise TargetError("no layer ids given: say which layers to capture (e.g. --layers 1,2,4)")
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad:
            raise TargetError(f"bad layer id(s) {bad}: valid ids are 0..{self.num_layers} for this "
                              f"{self.num_layers}-layer model (0 = embeddings, {self.num_layers} = last layer "
                              "output before the final norm)")
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise TargetError(f"duplicate layer id(s) {dup} in {ids}")
        return sorted(ids)

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))

    def _weight_file(self, name: str) -> Path:
        idx = self.path / "model.safetensors.index.json"
        if idx.exists():
            wm = json.loads(idx.read_text())["weight_map"]
            if name in wm:
                return self.path / wm[name]
        single = self.path / "model.safetensors"
        if single.exists():
            return single
        raise TargetError(f"model {self.path}: no safetensors file holds {name!r}")

    def tensor(self, *names: str) -> torch.Tensor:
        """The first of ``names`` present in the checkpoint, read alone (no full model load)."""
        from safetensors import safe_open

        for name in names:
            try:
                f = self._weight_file(name)
            except TargetError:
                continue
            with safe_open(str(f), framework="pt") as sf:
                if name in sf.keys():
                    return sf.get_tensor(name)
        raise TargetError(f"model {self.path}: none of {names} in its safetensors files")

    @cached_property
    def embedding(self) -> torch.Tensor:
        return self.tensor("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")

    def embedding_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding[token_ids.long()]
