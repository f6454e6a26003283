"""Tiny fixtures for drafter tests and debugging: a random tiny Qwen3 target and HF-reference records
(cached per process, so several test modules share one build)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from layertap.data import InputItem, load_inputs

CONVS = Path(__file__).resolve().parents[1] / "data_files" / "sample_convs.jsonl"
LAYERS = [0, 1, 2, 3, 4]  # every id of the 4-layer tiny target, N = 4 included


@functools.lru_cache(maxsize=None)
def tiny_target() -> Path:
    from layertap.models.tiny import tiny_model

    return tiny_model("qwen3")


@functools.lru_cache(maxsize=None)
def tiny_records(n: int = 8, greedy_tokens: int = 0) -> tuple:
    """HF-reference records of the first ``n`` sample conversations (truncated to 96 tokens); with
    ``greedy_tokens`` the assistant turn is replaced by that many greedily generated tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layertap.train.data import prompt_of, records_from_hf

    path = tiny_target()
    tok = AutoTokenizer.from_pretrained(str(path))
    items = load_inputs(str(CONVS), tok)[:n]
    items = [InputItem(it.index, it.token_ids[:96], it.loss_mask[:96], it.messages) for it in items]
    if greedy_tokens:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        out = []
        for it in items:
            p = tok.apply_chat_template(prompt_of(it.messages), tokenize=True, add_generation_prompt=True)
            p = list(p["input_ids"] if hasattr(p, "keys") else p)[-48:]
            with torch.no_grad():
                g = model.generate(torch.tensor([p]), max_new_tokens=greedy_tokens, do_sample=False,
                                   min_new_tokens=greedy_tokens)[0].tolist()
            out.append(InputItem(it.index, g, [0] * len(p) + [1] * (len(g) - len(p))))
        items = out
    return tuple(records_from_hf(path, items, LAYERS, extra_meta={"greedy_answer": bool(greedy_tokens)}))


def shape():
    from layertap.train.config import DrafterShape

    return DrafterShape(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256,
                        vocab_size=2048)
