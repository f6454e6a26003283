"""Typed configs for drafter training. Every field is documented; ``__post_init__`` raises ``ValueError``
naming the field. Layer ids everywhere are vLLM aux ids: id ``i`` = residual stream entering decoder
layer ``i`` (0 = embeddings, ``N`` = last layer output before the final norm)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def _positive(obj: Any, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if v <= 0:
            raise ValueError(f"{type(obj).__name__}.{n} must be > 0, got {v}")


@dataclass(kw_only=True, slots=True)
class DrafterShape:
    """Shape of the draft transformer; hidden size must equal the target's (shared embedding)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    """Target vocabulary size."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        _positive(self, "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"DrafterShape.num_kv_heads={self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")


@dataclass(kw_only=True, slots=True)
class Eagle3Config:
    """EAGLE-3 drafter: one decoder layer over [embed(token); fc(concat aux states)]."""

    shape: DrafterShape
    aux_layer_ids: list[int]
    """vLLM aux ids of the low/mid/high target states concatenated into ``fc``."""
    last_layer_id: int
    """Id of the pre-norm last state (= target num_hidden_layers); labels come from it via TargetHead."""
    draft_vocab_size: int
    ttt_steps: int = 3
    """Training-time-test unroll length (speculators default 3; SafeAILab 7)."""
    step_decay: float = 0.8
    """Loss weight of unroll step j is step_decay**j (SafeAILab/SpecForge 0.8)."""

    def __post_init__(self) -> None:
        _positive(self, "draft_vocab_size", "ttt_steps", "step_decay")
        if not self.aux_layer_ids:
            raise ValueError("Eagle3Config.aux_layer_ids must not be empty")
        if any(i < 0 or i > self.last_layer_id for i in self.aux_layer_ids):
            raise ValueError(f"Eagle3Config.aux_layer_ids={self.aux_layer_ids} must lie in "
                             f"[0, last_layer_id={self.last_layer_id}]")
        if self.last_layer_id in self.aux_layer_ids:
            # vLLM collects aux states inside the layer loop (ids 0..N-1): id N is never served.
            raise ValueError(f"Eagle3Config.aux_layer_ids may not contain last_layer_id={self.last_layer_id}: "
                             "vLLM only captures ids below num_hidden_layers")
        if self.draft_vocab_size > self.shape.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size={self.draft_vocab_size} exceeds "
                             f"vocab_size={self.shape.vocab_size}")


@dataclass(kw_only=True, slots=True)
class DFlashConfig:
    """DFlash block drafter conditioned on several target layers (KV injection), non-causal blocks."""

    shape: DrafterShape
    target_layer_ids: list[int]
    """DFlash convention: 0-based *output of layer k*; the captured aux id is k + 1."""
    num_layers: int = 2
    block_size: int = 8
    """B: anchor + B-1 mask slots; served with num_speculative_tokens = B - 1."""
    mask_token_id: int
    anchors_per_seq: int = 64
    """Anchors sampled per sequence per step (paper: up to 512)."""
    gamma: float = 4.0
    """Slot weights exp(-(j-1)/gamma); 4 for B=8, 7 for B=16 (ModelOpt doc)."""

    def __post_init__(self) -> None:
        _positive(self, "num_layers", "anchors_per_seq", "gamma")
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ValueError(f"DFlashConfig.target_layer_ids={self.target_layer_ids} must be non-empty, >= 0")
        if not 0 <= self.mask_token_id < self.shape.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id={self.mask_token_id} outside the vocabulary")

    @property
    def aux_layer_ids(self) -> list[int]:
        return [k + 1 for k in self.target_layer_ids]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Optimisation and bookkeeping, shared by both drafters."""

    out_dir: str
    """Checkpoints, TensorBoard events and the final PNG go here."""
    lr: float = 1e-3
    warmup_steps: int = 20
    max_steps: int = 200
    batch_size: int = 4
    """Records per optimizer step (right-padded). On several ranks this is the global batch: each of N
    ranks trains on batch_size / N of them (batch_size must be a multiple of N)."""
    max_len: int = 512
    """Records are truncated to this many tokens."""
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    seed: int = 0
    log_every: int = 10
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    tensorboard: bool = True
    device: str = "cpu"
    dtype: str = "float32"
    """Autocast dtype on CUDA ("bfloat16"); CPU trains in fp32."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Source-specific settings saved with the checkpoint (e.g. the offline epoch count, so a resume
    replays the same record order)."""

    def __post_init__(self) -> None:
        _positive(self, "lr", "max_steps", "batch_size", "max_len", "grad_clip", "log_every")
        for n in ("warmup_steps", "save_every", "weight_decay"):
            if getattr(self, n) < 0:
                raise ValueError(f"TrainConfig.{n} must be >= 0, got {getattr(self, n)}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainConfig.dtype must be float32 or bfloat16, got {self.dtype!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
