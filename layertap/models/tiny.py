"""Tiny target models built locally: a BPE tokenizer trained on text every machine has (the Python
standard library's source), a ChatML-style chat template, and random-weight Qwen3 / Llama / Mistral
(sliding window) checkpoints saved with ``save_pretrained``. No hub access anywhere.

Three kinds cover both shapes of vLLM's KV-cache grouping for the hidden-state capture layer:
``qwen3`` and ``llama`` (uniform full attention: the capture layer is merged into the one attention
group) and ``mistral-swa`` (every layer sliding-window: the capture layer gets a group of its own).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|mask|>"]

# ChatML with `{% generation %}` markers so `return_assistant_tokens_mask` works; the assistant's
# closing <|im_end|> is inside the marked span (the model must learn to stop).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

KINDS = ("qwen3", "llama", "mistral-swa")


@dataclass(frozen=True, kw_only=True)
class TinySpec:
    """Shape of a tiny target. Defaults fit the CPU machines (fp32, a few MB)."""

    kind: str = "qwen3"
    """One of ``KINDS``."""
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 2048
    max_position_embeddings: int = 2048
    sliding_window: int = 16
    """Only for ``mistral-swa``: small, so test prompts run well past the window."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TinySpec.kind: unknown model kind {self.kind!r}; expected one of {KINDS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"TinySpec.num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )


def corpus_files(limit_bytes: int = 4_000_000) -> list[str]:
    """Python standard library sources, sorted, up to ``limit_bytes`` (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(root.glob("*.py")):
        size = p.stat().st_size
        if total + size > limit_bytes:
            break
        files.append(str(p))
        total += size
    if not files:
        raise RuntimeError(f"no Python sources found under {root} to train the tokenizer on")
    return files


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer on the stdlib sources and save it (HF fast-tokenizer format)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(corpus_files(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<|pad|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>", "<|mask|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def hf_config(spec: TinySpec, tokenizer):
    """The transformers config for ``spec`` (ids taken from the tokenizer)."""
    from transformers import LlamaConfig, MistralConfig, Qwen3Config

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|pad|>"),
        bos_token_id=None,
        torch_dtype="float32",
    )
    if spec.kind == "qwen3":
        return Qwen3Config(**common, rope_theta=10000.0)
    if spec.kind == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    return MistralConfig(**common, rope_theta=10000.0, sliding_window=spec.sliding_window)


def _model_class(kind: str):
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM

    return {"qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM, "mistral-swa": MistralForCausalLM}[kind]


def spec_hash(spec: TinySpec) -> str:
    return hashlib.sha256(json.dumps(spec.__dict__, sort_keys=True).encode()).hexdigest()[:12]


def build_tiny_model(out_dir: str | os.PathLike, spec: TinySpec | None = None, *, overwrite: bool = False,
                     device: str | None = None, save_dtype: str = "float32") -> Path:
    """Build a random-weight tiny model at ``out_dir`` (deterministic in ``spec.seed`` and ``device``);
    returns the path.

    Reuses an existing build of the same spec unless ``overwrite``. The weights are scaled so the
    residual stream stays well-conditioned across layers (cosine checks stay meaningful). ``device``: where
    the weights are initialized (e.g. ``"cuda"``: seconds instead of minutes for an 8B-shaped benchmark
    model; other random values than a CPU build); ``save_dtype``: the checkpoint's dtype (``"bfloat16"``
    halves what is written and read). Callers keep builds of different devices or dtypes in different
    folders.
    """
    import torch

    spec = spec or TinySpec()
    out = Path(out_dir)
    stamp = out / "layertap_tiny.json"
    if not overwrite and stamp.exists() and json.loads(stamp.read_text()).get("hash") == spec_hash(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, spec.vocab_size)
    torch.manual_seed(spec.seed)
    with torch.device(device or "cpu"):  # torch.manual_seed seeds CUDA generators too
        model = _model_class(spec.kind)(hf_config(spec, tokenizer))
    model.to(getattr(torch, save_dtype))
    model.config.torch_dtype = save_dtype
    model.save_pretrained(str(out), safe_serialization=True)
    model.generation_config.save_pretrained(str(out))
    del model
    if str(device).startswith("cuda"):  # the caller's engines size their caches from the free memory
        torch.cuda.empty_cache()
    stamp.write_text(json.dumps({"hash": spec_hash(spec), "spec": spec.__dict__}, indent=1))
    return out


def default_cache_dir() -> Path:
    """Where built models are cached: ``$LAYERTAP_CACHE`` or ``~/.cache/layertap``."""
    return Path(os.environ.get("LAYERTAP_CACHE", Path.home() / ".cache" / "layertap"))


def tiny_model(kind: str = "qwen3", **overrides) -> Path:
    """Path of a cached tiny model of ``kind`` (built on first use)."""
    spec = TinySpec(kind=kind, **overrides)
    return build_tiny_model(default_cache_dir() / f"tiny-{kind}-{spec_hash(spec)}", spec)
