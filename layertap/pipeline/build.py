"""From a ``PipelineConfig`` to the pieces of a run: target, inputs, held-out prompts, layers, engine
settings, the Tap factory and a fresh trainer. Pure set-up; the loop lives in ``run.py``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from layertap.data import InputItem, load_inputs, read_jsonl
from layertap.pipeline.config import PipelineConfig

SAMPLE_CONVS = Path(__file__).resolve().parents[1] / "data_files" / "sample_convs.jsonl"


@dataclass
class Plan:
    target: str
    num_layers: int
    layers: list[int]
    """Captured vLLM aux ids: the drafter's aux ids plus the pre-norm last state (EAGLE-3 labels)."""
    items: list[InputItem]
    """Training inputs for every epoch; ``index`` = epoch * num_convs + position (unique, resumable)."""
    eval_prompts: list[list[int]]
    mode: str
    max_tokens: int
    engine: dict[str, Any]
    counts_items: list[InputItem]
    """One epoch of tokenized conversations (draft-vocabulary counts from their assistant tokens)."""


def resolve_target(cfg: PipelineConfig) -> str:
    if cfg.target:
        return str(cfg.target)
    from layertap.models.train_target import trained_target

    return str(trained_target())


def default_aux_layers(n: int) -> list[int]:
    """vLLM's EAGLE-3 default (2, L//2, L-3) where it gives distinct ids, else every id in 1..L-1."""
    ids = sorted({2, n // 2, n - 3})
    return ids if n >= 6 and len(ids) == 3 else list(range(1, n))


def engine_kwargs(cfg: PipelineConfig) -> dict[str, Any]:
    """CPU defaults (eager, a small KV cache, 1024 context) under the user's own engine kwargs."""
    base: dict[str, Any] = {}
    if not torch.cuda.is_available():
        base = {"enforce_eager": True, "kv_cache_memory_bytes": 128 << 20, "max_model_len": 1024}
    return {**base, **cfg.engine}


def _prompt_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    from layertap.train.data import prompt_of

    ids = tok.apply_chat_template(prompt_of(messages), tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def make_plan(cfg: PipelineConfig) -> Plan:
    from transformers import AutoTokenizer

    from layertap.targetinfo import TargetInfo

    target = resolve_target(cfg)
    info = TargetInfo.load(target)
    n = int(info.num_layers)
    layers = sorted(set(cfg.capture.layers or default_aux_layers(n)) | {n})
    tok = AutoTokenizer.from_pretrained(target)
    lines = [obj for _, obj in read_jsonl(cfg.data or SAMPLE_CONVS)]
    hold = cfg.capture.eval_holdout
    if hold >= len(lines):
        raise ValueError(f"capture.eval_holdout={hold} leaves no training data out of {len(lines)} conversations")
    train_lines, eval_lines = lines[: len(lines) - hold], lines[len(lines) - hold :]
    if cfg.capture.limit:
        train_lines = train_lines[: cfg.capture.limit]
    base = load_inputs(train_lines, tok)
    regen = cfg.capture.regenerate
    items = []
    rng = random.Random(cfg.train.seed)
    for e in range(cfg.capture.epochs):
        order = list(range(len(base)))
        rng.shuffle(order)
        for pos, k in enumerate(order):
            it = base[k]
            if regen and it.messages is None:
                raise ValueError(f"input {k}: capture.regenerate needs conversations (messages)")
            ids = _prompt_ids(tok, it.messages) if regen else it.token_ids
            items.append(InputItem(e * len(base) + pos, ids, None if regen else it.loss_mask, it.messages))
    prompts = []
    for obj in eval_lines[: cfg.eval.num_prompts]:
        msgs = load_inputs([obj], tok)[0].messages
        if msgs is None:
            raise ValueError("evaluation prompts must be conversations (messages)")
        prompts.append(_prompt_ids(tok, msgs))
    return Plan(target=target, num_layers=n, layers=layers, items=items, eval_prompts=prompts,
                mode="generate" if regen else "prompt", max_tokens=cfg.capture.max_tokens,
                engine=engine_kwargs(cfg), counts_items=base)


def transport_config(cfg: PipelineConfig, out: Path) -> tuple[str, dict[str, Any], str | None]:
    """(transport name, its config, ``out`` for the file transport)."""
    c = cfg.capture
    if c.transport == "shm":
        return "shm", {"slot_bytes": c.shm_slot_mb << 20, "num_slots": c.shm_slots}, None
    if c.transport == "mooncake":
        return "mooncake", {"master": c.mooncake_master}, None
    return "file", {}, str(c.file_dir or out / "records")


def tap_factory(cfg: PipelineConfig, plan: Plan, out: Path) -> Callable[[], Any]:
    def make() -> Any:
        from layertap.tap import Tap

        name, tcfg, file_out = transport_config(cfg, out)
        return Tap(plan.target, plan.layers, transport=name, transport_config=tcfg, out=file_out,
                   max_inflight=cfg.capture.max_inflight, record_timeout=cfg.capture.record_timeout,
                   **plan.engine)

    return make


def sampling_params(plan: Plan) -> Any:
    if plan.mode == "prompt":
        return None
    from vllm import SamplingParams

    return SamplingParams(max_tokens=plan.max_tokens, temperature=0.0)


def item_token_counts(items: list[InputItem], vocab: int) -> torch.Tensor:
    """Counts of assistant tokens of the conversations: the EAGLE-3 draft vocabulary's basis. With
    ``regenerate`` the target's own answers are not known before training; the data's answers stand in."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for it in items:
        ids = torch.tensor(it.token_ids, dtype=torch.long)
        keep = torch.tensor(it.loss_mask, dtype=torch.bool) if it.loss_mask else torch.ones_like(ids, dtype=torch.bool)
        counts += torch.bincount(ids[keep], minlength=vocab)[:vocab]
    return counts


def new_trainer(cfg: PipelineConfig, plan: Plan, out: Path) -> Any:
    from layertap.drafters.eagle3 import draft_vocab_from_counts
    from layertap.pipeline.drafter_config import drafter_config
    from layertap.train.config import TrainConfig
    from layertap.train.trainer import Trainer

    t = cfg.train
    dcfg = drafter_config(cfg.drafter, plan.target, plan.layers, draft_vocab=t.draft_vocab, ttt_steps=t.ttt_steps,
                          dflash_layers=t.dflash_layers, block_size=t.block_size)
    tcfg = TrainConfig(out_dir=str(out), lr=t.lr, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                       batch_size=t.batch_size, max_len=t.max_len, seed=t.seed, log_every=t.log_every,
                       save_every=0, tensorboard=False, device=t.device,
                       dtype="bfloat16" if t.device.startswith("cuda") else "float32",
                       extra={"consumed": [], "online": True})
    ids = None
    if cfg.drafter == "eagle3":
        ids = draft_vocab_from_counts(item_token_counts(plan.counts_items, dcfg.shape.vocab_size),
                                      dcfg.draft_vocab_size)
    return Trainer(cfg.drafter, dcfg, tcfg, plan.target, ids)
