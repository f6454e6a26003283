"""Shared helpers for the real-engine tests (vLLM CPU build, tiny local models)."""

from __future__ import annotations

import random


from layertap.verify import HFReference, compare

# Small, fp32 (the HF reference runs fp32; cosine >= 0.999 per token and layer), several engines fit in RAM.
# disable_log_stats=False: the tests read vLLM's counters (prefix-cache hits, block counts); the Tap leaves
# vLLM's default (off) otherwise
BASE = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024, disable_log_stats=False)

_REFS: dict[str, HFReference] = {}


def reference(model) -> HFReference:
    key = str(model)
    if key not in _REFS:
        _REFS[key] = HFReference(model)
    return _REFS[key]


def assert_all_match(records, model, threshold: float = 0.999) -> int:
    """Every record's every token and layer matches HF; returns the number of tokens checked."""
    ref = reference(model)
    tokens = 0
    assert records, "no records"
    for rec in records:
        rec.check()
        cos, _ = compare(rec, ref.planes(rec.token_ids, rec.layer_ids))
        worst = float(cos.min())
        assert worst >= threshold, f"record {rec.key} (index {rec.index}): min cosine {worst:.5f}"
        tokens += cos.shape[0]
    return tokens


def random_prompts(n: int, lengths: list[int], vocab: int = 2000, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"token_ids": [rng.randrange(10, vocab) for _ in range(lengths[i % len(lengths)])]} for i in range(n)]


def metric(llm, name: str) -> float:
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name:
            total += float(getattr(m, "value", 0) or 0)
    return total
