"""Capture on Llama under forced preemption (tiny KV cache), and on a sliding-window Mistral whose capture
layer gets a KV-cache group of its own (confirmed from the connector's start-up log)."""

import pytest

from layertap.models.tiny import tiny_model
from layertap.tap import Tap

from .helpers import BASE, assert_all_match, metric, random_prompts

pytestmark = pytest.mark.engine


def test_llama_preemption_forced_by_tiny_kv_cache():
    from vllm import SamplingParams

    model = tiny_model("llama")
    # ~4 MiB of KV cache holds a handful of 128-token blocks; 16 requests growing to ~330 tokens each
    # cannot all fit, so the scheduler must preempt and recompute.
    with Tap(model=model, layers=[1, 2, 4], **{**BASE, "kv_cache_memory_bytes": 4 << 20, "max_model_len": 512},
             max_num_seqs=16, max_num_batched_tokens=256) as tap:
        inputs = random_prompts(16, [150, 200, 230], seed=11)
        sp = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        recs = list(tap.capture(inputs, mode="generate", sampling_params=sp))
        preempted = metric(tap.llm, "vllm:num_preemptions")
    assert preempted > 0, "the tiny KV cache did not force a preemption; the test would prove nothing"
    assert sorted(r.index for r in recs) == list(range(16))
    for r in recs:
        assert r.hidden_states.shape[0] == len(inputs[r.index]["token_ids"]) + 100 - 1
    assert_all_match(recs, model)
    # Uniform full attention: vLLM merges the capture layer into the one attention group.
    assert recs[0].meta["cache_group"]["own_group"] is False and recs[0].meta["cache_group"]["num_groups"] == 1


def test_sliding_window_model_capture_layer_in_its_own_group(capfd):
    from vllm import SamplingParams

    model = tiny_model("mistral-swa")  # every layer sliding (window 16); prompts run far past it
    with Tap(model=model, layers=[0, 2, 3, 4], **BASE, max_num_seqs=32, max_num_batched_tokens=128,
             enable_prefix_caching=True) as tap:
        inputs = random_prompts(40, [5, 33, 200, 410], seed=12)
        shared = random_prompts(1, [300], seed=13)[0]["token_ids"]
        inputs += [{"token_ids": shared + s["token_ids"]} for s in random_prompts(6, [7, 50], seed=14)]
        recs = list(tap.capture(inputs))
        gen = list(tap.capture(random_prompts(6, [40, 90], seed=15), mode="generate",
                               sampling_params=SamplingParams(max_tokens=20, ignore_eos=True)))
    assert len(recs) == 46 and len(gen) == 6
    assert_all_match(recs + gen, model)
    group = recs[0].meta["cache_group"]
    assert group["own_group"] is True and group["group_types"] == ["SlidingWindowSpec", "HiddenStateCacheSpec"]
    # The connector's start-up log (printed by the engine processes) says the same.
    log = capfd.readouterr()
    text = log.out + log.err
    assert "hidden-state group 1 of ['SlidingWindowSpec', 'HiddenStateCacheSpec']" in text
    assert "layertap worker: capture layer" in text and "slot check passed" in text
