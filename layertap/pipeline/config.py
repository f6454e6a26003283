"""Typed configuration of ``layertap train``: nested dataclasses, a YAML file, ``--set a.b=c`` overrides.

Every field carries its help text in ``metadata["help"]`` so ``layertap train --help`` lists every key
(``config_help``). ``__post_init__`` raises ``ValueError`` naming the field; a YAML or ``--set`` key that
is not a field is an error naming the valid keys. ``None`` means "the embedded default" (tiny trained
target, bundled sample conversations, layers chosen for the drafter).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _f(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - the argparse word
    if callable(default) and not isinstance(default, (int, float, str, bool)):
        return field(default_factory=default, metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _need(cond: bool, name: str, msg: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"{name} {msg}, got {value!r}")


@dataclass(kw_only=True, slots=True)
class CaptureSection:
    """What the engine(s) capture and how records travel to the trainer."""

    transport: str = _f("shm", "record transport: shm (one machine) | mooncake (across machines) | file")
    layers: list[int] | None = _f(None, "vLLM aux layer ids to capture (default: what the drafter needs)")
    regenerate: bool = _f(True, "on-policy: capture prompt + the target's own greedy answer (generate mode)")
    max_tokens: int = _f(96, "answer length cap when regenerating")
    epochs: int = _f(2, "passes of the training conversations through the engine (reshuffled each pass)")
    limit: int | None = _f(None, "use only the first N training conversations")
    eval_holdout: int = _f(16, "the last N conversations are held out as evaluation prompts, never trained on")
    max_inflight: int = _f(16, "requests in flight per engine (also bounded by the transport's free capacity)")
    queue_records: int = _f(32, "records buffered between the producer thread and the trainer")
    shm_slot_mb: int = _f(4, "shm: MiB per pool slot")
    shm_slots: int = _f(32, "shm: pool slots (pool size = slots x slot MiB, allocated up front)")
    mooncake_master: str | None = _f(None, "mooncake: master address host:port (required for mooncake)")
    file_dir: str | None = _f(None, "file: dataset directory (default OUT/records)")
    record_timeout: float = _f(120.0, "seconds to wait for a finished request's record before failing it")

    def __post_init__(self) -> None:
        _need(self.transport in ("shm", "mooncake", "file"), "capture.transport", "must be shm|mooncake|file",
              self.transport)
        for n in ("max_tokens", "epochs", "max_inflight", "queue_records", "shm_slot_mb", "shm_slots"):
            _need(getattr(self, n) > 0, f"capture.{n}", "must be > 0", getattr(self, n))
        _need(self.eval_holdout >= 0, "capture.eval_holdout", "must be >= 0", self.eval_holdout)
        _need(self.limit is None or self.limit > 0, "capture.limit", "must be > 0", self.limit)
        _need(self.layers is None or (bool(self.layers) and min(self.layers) >= 0), "capture.layers",
              "must be non-empty ids >= 0", self.layers)
        _need(self.transport != "mooncake" or bool(self.mooncake_master), "capture.mooncake_master",
              "is required with transport mooncake", self.mooncake_master)


@dataclass(kw_only=True, slots=True)
class TrainSection:
    """Online optimisation (the trainer of ``layertap.train``)."""

    max_steps: int = _f(120, "optimizer steps (the LR schedule's length); training ends earlier if data runs out")
    batch_size: int = _f(4, "records per optimizer step")
    lr: float = _f(2e-3, "peak learning rate (AdamW, warmup + cosine)")
    warmup_steps: int = _f(10, "linear warmup steps")
    max_len: int = _f(384, "records are truncated to this many tokens")
    seed: int = _f(0, "seed for init, data order and anchor sampling")
    save_every: int = _f(40, "checkpoint every N steps (and at the end); resume starts from the last one")
    log_every: int = _f(20, "console log interval in steps")
    draft_vocab: int | None = _f(None, "eagle3 draft vocabulary (default: half the vocab for tiny vocabs, else 32000)")
    ttt_steps: int = _f(3, "eagle3 training-time-test unroll length")
    block_size: int = _f(4, "dflash block size B (served with B-1 speculative tokens)")
    dflash_layers: int = _f(2, "dflash draft decoder layers")
    device: str = _f("cpu", "torch device of the trainer")
    threads: int | None = _f(None, "torch CPU threads of the trainer (default on CPU: half the cores, the engine "
                              "uses the rest; oversubscribed threads made steps 5-10x slower on 2 cores)")

    def __post_init__(self) -> None:
        for n in ("max_steps", "batch_size", "lr", "max_len", "log_every", "ttt_steps", "dflash_layers"):
            _need(getattr(self, n) > 0, f"train.{n}", "must be > 0", getattr(self, n))
        for n in ("warmup_steps", "save_every"):
            _need(getattr(self, n) >= 0, f"train.{n}", "must be >= 0", getattr(self, n))
        _need(self.block_size >= 2, "train.block_size", "must be >= 2", self.block_size)
        _need(self.draft_vocab is None or self.draft_vocab > 0, "train.draft_vocab", "must be > 0", self.draft_vocab)
        _need(self.threads is None or self.threads > 0, "train.threads", "must be > 0", self.threads)


@dataclass(kw_only=True, slots=True)
class EvalSection:
    """Acceptance measured in vLLM (its own spec-decode counters) against an ngram drafter."""

    every: int = _f(60, "also evaluate the checkpoint every N steps in a background process (0: only at the end)")
    num_prompts: int = _f(16, "held-out prompts decoded per evaluation (at most capture.eval_holdout)")
    max_tokens: int = _f(48, "tokens generated per prompt")
    num_spec: int = _f(3, "eagle3 speculative tokens per step (dflash: block_size - 1)")
    ngram_k: int = _f(3, "ngram drafter speculative tokens")
    kv_cache_mb: int = _f(64, "KV cache MiB of the evaluation engines")
    enabled: bool = _f(True, "run the final evaluation (acceptance table) at all")

    def __post_init__(self) -> None:
        for n in ("num_prompts", "max_tokens", "num_spec", "ngram_k", "kv_cache_mb"):
            _need(getattr(self, n) > 0, f"eval.{n}", "must be > 0", getattr(self, n))
        _need(self.every >= 0, "eval.every", "must be >= 0", self.every)


@dataclass(kw_only=True, slots=True)
class PipelineConfig:
    """One ``layertap train`` run."""

    target: str | None = _f(None, "target model directory (default: the tiny trained Qwen3, built on first use)")
    data: str | None = _f(None, "conversations JSONL (default: the bundled sample_convs.jsonl)")
    drafter: str = _f("eagle3", "drafter kind: eagle3 | dflash")
    out: str = _f("runs/layertap-train", "run directory: checkpoint, exported drafter, report")
    engine: dict[str, Any] = _f(dict, "vLLM engine kwargs by vLLM's names (also: unknown CLI flags)")
    capture: CaptureSection = _f(CaptureSection, "capture and transport")
    train: TrainSection = _f(TrainSection, "training")
    eval: EvalSection = _f(EvalSection, "evaluation")

    def __post_init__(self) -> None:
        _need(self.drafter in ("eagle3", "dflash"), "drafter", "must be eagle3 or dflash", self.drafter)
        _need(bool(self.out), "out", "must be a directory path", self.out)
        for n in ("capture", "train", "eval"):
            want = _SECTIONS[n]
            _need(isinstance(getattr(self, n), want), n, f"must be a {want.__name__}", getattr(self, n))
        _need(isinstance(self.engine, dict), "engine", "must be a mapping of vLLM engine kwargs", self.engine)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SECTIONS: dict[str, type] = {"capture": CaptureSection, "train": TrainSection, "eval": EvalSection}


# -- building from dicts, YAML and overrides ---------------------------------------------------------
def _check_keys(cls: type, d: dict[str, Any], where: str) -> None:
    names = [f.name for f in dataclasses.fields(cls)]
    bad = [k for k in d if k not in names]
    if bad:
        raise ValueError(f"unknown config key{'s' if len(bad) > 1 else ''} {', '.join(where + k for k in bad)}; "
                         f"valid keys{' under ' + where.rstrip('.') if where else ''}: {', '.join(names)}")


def _coerce(typ: Any, val: Any, name: str) -> Any:
    """Check ``val`` against the field type (ints widen to float); raise naming the key otherwise."""
    opts = typing.get_args(typ) if typing.get_origin(typ) in (typing.Union, types.UnionType) else (typ,)
    for t in opts:
        if t is type(None) and val is None:
            return None
        origin = typing.get_origin(t) or t
        if origin is float and isinstance(val, (int, float)) and not isinstance(val, bool):
            return float(val)
        if origin is int and isinstance(val, int) and not isinstance(val, bool):
            return val
        if origin is list and isinstance(val, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in val):
            return val
        if origin in (str, bool, dict) and isinstance(val, origin):
            return val
    raise ValueError(f"{name} must be {typ}, got {val!r}")


def _build(cls: type, d: dict[str, Any], where: str) -> Any:
    _check_keys(cls, d, where)
    hints = typing.get_type_hints(cls)
    return cls(**{k: _coerce(hints[k], v, where + k) for k, v in d.items()})


def from_dict(d: dict[str, Any]) -> PipelineConfig:
    """Build a config from a nested mapping; unknown keys raise ``ValueError`` naming them."""
    if not isinstance(d, dict):
        raise ValueError(f"config must be a mapping, got {type(d).__name__}")
    _check_keys(PipelineConfig, d, "")
    kw = dict(d)
    for name, cls in _SECTIONS.items():
        sec = kw.get(name) or {}
        if not isinstance(sec, dict):
            raise ValueError(f"config section {name!r} must be a mapping, got {type(sec).__name__}")
        kw[name] = _build(cls, sec, name + ".")
    top = {k: v for k, v in kw.items() if k not in _SECTIONS}
    hints = typing.get_type_hints(PipelineConfig)
    top = {k: _coerce(hints[k], v, k) for k, v in top.items()}
    return PipelineConfig(**{**kw, **top})


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"config file {p} does not exist")
    d = yaml.safe_load(p.read_text()) or {}
    if not isinstance(d, dict):
        raise ValueError(f"config file {p}: expected a mapping at the top, got {type(d).__name__}")
    return d


def _field_type(cls: type, name: str) -> Any:
    return typing.get_type_hints(cls)[name]


def _parse_value(raw: str, typ: Any, key: str) -> Any:
    import yaml

    try:
        val = yaml.safe_load(raw)  # YAML scalars: 3, 1e-3, true, null, [1, 2]
    except yaml.YAMLError as e:
        raise ValueError(f"--set {key}={raw}: not a YAML value ({e})") from None
    base = {t for t in typing.get_args(typ)} or {typ}
    if str in base and val is not None and not isinstance(val, str):
        val = raw  # a path or name that YAML read as a number
    if float in base and isinstance(val, int) and not isinstance(val, bool):
        val = float(val)
    if float in base and isinstance(val, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
        try:
            val = float(val)
        except ValueError:
            pass  # left to the type check, which names the key
    return val


def apply_overrides(d: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` overrides to a config mapping (values parsed as YAML scalars/lists)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for s in sets:
        key, eq, raw = s.partition("=")
        if not eq:
            raise ValueError(f"--set expects KEY=VALUE, got {s!r}")
        parts = key.strip().split(".")
        if len(parts) == 1:
            _check_keys(PipelineConfig, {parts[0]: None}, "")
            typ = _field_type(PipelineConfig, parts[0])
            out[parts[0]] = _parse_value(raw, typ, key)
        elif len(parts) == 2 and parts[0] == "engine":
            out.setdefault("engine", {})[parts[1]] = _parse_value(raw, Any, key)
        elif len(parts) == 2 and parts[0] in _SECTIONS:
            _check_keys(_SECTIONS[parts[0]], {parts[1]: None}, parts[0] + ".")
            typ = _field_type(_SECTIONS[parts[0]], parts[1])
            out.setdefault(parts[0], {})[parts[1]] = _parse_value(raw, typ, key)
        else:
            raise ValueError(f"unknown config key {key!r}; use top-level keys or "
                             f"{'|'.join(['engine', *_SECTIONS])}.KEY")
    return out


def config_help() -> str:
    """Every config key with its default and help, for ``--help``."""
    lines = []
    for f in dataclasses.fields(PipelineConfig):
        if f.name in _SECTIONS:
            continue
        lines.append(f"  {f.name:<26} {f.metadata['help']}")
    for name, cls in _SECTIONS.items():
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else "{}"
            lines.append(f"  {name + '.' + f.name:<26} {f.metadata['help']} [{default}]")
    return "\n".join(lines)
