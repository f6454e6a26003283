"""Capture on CUDA vLLM (bf16), eager and compiled, against HF transformers on the GPU (cosine >= 0.99
per token and layer), with concurrency, chunked prefill and prefix caching; the layer-0 eager-mode bug of
vLLM 0.25 is refused up front and caught by the first-record check; tensor parallel 2 when two GPUs."""


import pytest
import torch

from layertap.engine.compat import KnownVLLMBug
from layertap.models.tiny import tiny_model
from layertap.tap import LayerZeroMismatch, Tap
from layertap.verify import HFReference, compare

from tests.engine.helpers import random_prompts

SHAPE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)
ENGINE = dict(dtype="bfloat16", gpu_memory_utilization=0.2, max_model_len=2048, max_num_seqs=64,
              max_num_batched_tokens=256, enable_prefix_caching=True,
              disable_log_stats=False)  # the tests read vLLM's prefix-cache counters
_REF = {}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", **SHAPE)


def ref(model):
    if "r" not in _REF:
        _REF["r"] = HFReference(model, dtype=torch.bfloat16, device="cuda")
    return _REF["r"]


def check(records, model, threshold=0.99):
    assert records
    worst = 1.0
    for rec in records:
        cos, _ = compare(rec, ref(model).planes(rec.token_ids, rec.layer_ids))
        worst = min(worst, float(cos.min()))
        assert float(cos.min()) >= threshold, f"record {rec.key}: min cosine {float(cos.min()):.4f}"
    print(f"{len(records)} records, worst per-token cosine {worst:.5f}")


def workload():
    varied = random_prompts(64, [1, 9, 70, 255, 256, 257, 600, 1500], seed=21)  # chunked: budget 256
    prefix = random_prompts(2, [700], seed=22)
    shared = [{"token_ids": prefix[i % 2]["token_ids"] + s["token_ids"]}
              for i, s in enumerate(random_prompts(24, [3, 40, 200], seed=23))]
    return varied, shared


@pytest.mark.parametrize("mode", ["compiled", "eager", "compiled-extract", "compiled-piecewise"])
def test_capture_matches_hf_in_bf16(model, mode, capfd):
    """Compiled mode writes rows straight into the registered shm pool (the default); eager mode stages
    them through pinned buffers (connector_options direct=False), so both record paths are checked.
    The hook capture path (default) runs with vLLM's default scheduling (async on 0.25/CUDA), generate
    mode included; ``compiled-extract`` runs the same workload through vLLM's extract_hidden_states;
    ``compiled`` keeps vLLM's FULL CUDA graphs for decode (the default), so the generate-mode decode rows
    are written by graph replays; ``compiled-piecewise`` (connector option full_graphs=False) lets vLLM
    fall back to PIECEWISE graphs, the control that the log check below can fail."""
    from vllm import SamplingParams

    from layertap.engine.compat import async_scheduling

    layers = [1, 2, 4] if mode == "eager" else [0, 1, 2, 4]
    opts = {"direct": False} if mode == "eager" else {"full_graphs": False} if mode == "compiled-piecewise" else {}
    path = "extract" if mode.endswith("extract") else "hook"
    varied, shared = workload()
    with Tap(model=model, layers=layers, enforce_eager=(mode == "eager"), connector_options=opts,
             capture_path=path, **ENGINE) as tap:
        print(f"{mode}: capture path {path}, async scheduling {async_scheduling(tap.llm)}")
        recs = list(tap.capture(varied))
        recs += list(tap.capture(shared[:2])) + list(tap.capture(shared))  # second pass hits the prefix cache
        gen = list(tap.capture(random_prompts(16, [30, 300], seed=24), mode="generate",
                               sampling_params=SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)))
        hits = sum(float(m.value) for m in tap.llm.get_metrics() if m.name == "vllm:prefix_cache_hits")
    assert len(recs) == 64 + 2 + 24 and len(gen) == 16
    assert hits > 0
    check(recs + gen, model)
    log = capfd.readouterr()
    text = log.out + log.err
    if path == "hook":  # the rows went in through vLLM's cache-write kernel, self-checked
        assert "kernel scatter)" in text and "kernel scatter checked against the planes" in text, text[-3000:]
    if mode == "compiled":  # the engine kept FULL graphs (vLLM logs the fallback when it does not)
        assert "declares UNIFORM_BATCH CUDA-graph support" in text
        assert "setting cudagraph_mode=PIECEWISE" not in text, "vLLM still fell back to PIECEWISE graphs"
        assert "decode steps run with FULL CUDA graphs" in text  # the connector's own start-up report
        # the records were copied and committed by the record process (record_proc), not the step thread
        assert "the record process copies and commits" in text and "record process did not start" not in text
    if mode == "compiled-piecewise":
        assert "setting cudagraph_mode=PIECEWISE" in text, "the control kept FULL graphs"
        assert "decode steps run with PIECEWISE CUDA graphs" in text


def test_extract_path_with_async_scheduling_prompt_mode_only(model):
    """On the extract path, async_scheduling=True is allowed for prompt mode (its rows end with the prompt)
    and refused for generate mode on vLLM 0.25 (decode rows came back unwritten there)."""
    varied, shared = workload()
    with Tap(model=model, layers=[1, 2, 4], async_scheduling=True, capture_path="extract", **ENGINE) as tap:
        recs = list(tap.capture(varied)) + list(tap.capture(shared[:2])) + list(tap.capture(shared))
        with pytest.raises(KnownVLLMBug, match="generate mode needs"):
            list(tap.capture(varied[:2], mode="generate"))
    assert len(recs) == 64 + 2 + 24
    check(recs, model)


def test_layer_zero_eager_bug_is_refused_and_detected(model, monkeypatch):
    with pytest.raises(KnownVLLMBug, match="layer id 0"):
        Tap(model=model, layers=[0, 2], enforce_eager=True, **ENGINE)
    monkeypatch.setenv("LAYERTAP_ALLOW_KNOWN_BUGS", "1")
    with Tap(model=model, layers=[0, 2], enforce_eager=True, **ENGINE) as tap:
        with pytest.raises(LayerZeroMismatch, match="layer id 0 is not the token embedding"):
            list(tap.capture(random_prompts(8, [50], seed=25)))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel needs two GPUs (nvidia-h200-x2)")
def test_tensor_parallel_2_rank0_writes_and_records_match(model):
    from vllm import SamplingParams

    varied, shared = workload()
    with Tap(model=model, layers=[1, 2, 4], tensor_parallel_size=2, **ENGINE) as tap:
        recs = list(tap.capture(varied[:32])) + list(tap.capture(shared))
        gen = list(tap.capture(random_prompts(8, [30, 300], seed=26), mode="generate",
                               sampling_params=SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)))
    assert len({r.key for r in recs}) == len(recs) == 32 + 24  # one record per request: only rank 0 writes
    assert len({r.key for r in gen}) == len(gen) == 8
    assert all(r.num_prompt_tokens + 31 == r.token_ids.shape[0] for r in gen)
    check(recs + gen, model)
