"""Analysis API (``Tap.generate``): vLLM's outputs unchanged, plus per-sample hidden states and logits
proven against an HF recomputation of prompt + generated tokens. One engine for the module, with prefix
caching on and chunked prefill (every prompt is longer than ``max_num_batched_tokens``), compiled mode."""

import pytest
import torch

from layertap.analysis import AnalysisError, check_settings, logit_rows, sample_keys
from layertap.engine.connector import PARAMS_KEY
from layertap.models.tiny import tiny_model
from layertap.tap import Tap
from layertap.verify import row_cosine

from .helpers import BASE, metric, random_prompts, reference

pytestmark = pytest.mark.engine
LAYERS = [0, 2, 4]  # 4 = N: the last layer, post-norm in this module's Tap
N = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def tap(model):
    t = Tap(model=model, layers=LAYERS, post_norm_last=True, **{**BASE, "max_model_len": 512}, max_num_seqs=64,
            max_num_batched_tokens=128, enable_prefix_caching=True)
    yield t
    t.close()


@torch.no_grad()
def hf_expect(model, token_ids: list[int], post_norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's planes for LAYERS (plane N post-norm when asked: HF's last hidden state) and its logits."""
    ref = reference(model)
    out = ref.model(input_ids=torch.tensor([token_ids]), output_hidden_states=True, use_cache=False)
    planes = ref.planes(torch.tensor(token_ids), LAYERS)
    if post_norm:
        planes[:, LAYERS.index(N)] = out.hidden_states[-1][0]
    return planes, out.logits[0].float()


def assert_sample_matches_hf(model, out, comp, post_norm: bool = True) -> int:
    ran = list(out.prompt_token_ids) + list(comp.token_ids)[:-1]  # the last sampled token never ran
    hs = comp.hidden_states
    assert hs.shape == (len(ran), len(LAYERS), 128), (hs.shape, len(ran))
    assert comp.layer_ids == LAYERS
    planes, logits = hf_expect(model, ran, post_norm)
    cos = row_cosine(hs.float(), planes.float())  # a zero-embedding token (pad) is zero in both: a match
    assert float(cos.min()) >= 0.999, f"{out.request_id} sample {comp.index}: min cosine {float(cos.min()):.5f}"
    if comp.logits is not None:
        rows = comp.logits_positions
        assert comp.logits.shape == (len(rows), 2048)
        torch.testing.assert_close(comp.logits, logits[rows], atol=2e-3, rtol=2e-3)
    return len(ran)


def test_pure_helpers():
    assert sample_keys("r", "a-1-2-9ee4cd0f", 1) == ["r:a-1-2-9ee4cd0f"]
    assert sample_keys("r", "a-9e", 3) == ["r:0_a-9e", "r:1_a-9e", "r:2_a-9e"]
    assert logit_rows("generated", n_rows=9, n_prompt=5) == [4, 5, 6, 7, 8]  # G = 9 - 5 + 1 = 5
    assert logit_rows([-1, 0], 9, 5) == [8, 0]
    with pytest.raises(AnalysisError, match=r"rows \[9\]"):
        logit_rows([9], 9, 5)
    with pytest.raises(AnalysisError, match="layer id 4"):
        check_settings([0, 2], 4, True, None)
    with pytest.raises(AnalysisError, match="logits_at='last'"):
        check_settings([0, 2], 4, False, "last")
    check_settings([0, 2], 4, False, None)


def test_sampled_n2_concurrent_prefix_cached_chunked(tap, model):
    from vllm import SamplingParams

    prefixes = random_prompts(3, [140], seed=11)
    suffixes = random_prompts(24, [3, 20, 45], seed=12)
    prompts = [{"prompt_token_ids": prefixes[i % 3]["token_ids"] + s["token_ids"]} for i, s in enumerate(suffixes)]
    hits0 = metric(tap.llm, "vllm:prefix_cache_hits")
    sp = SamplingParams(max_tokens=20, temperature=0.8, n=2, logprobs=2, ignore_eos=True)
    outs = tap.generate(prompts, sp, logits_at="generated")
    assert metric(tap.llm, "vllm:prefix_cache_hits") - hits0 >= 128, "expected prefix-cache hits"
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in prompts]
    tokens = 0
    for out in outs:
        assert [c.index for c in out.outputs] == [0, 1]
        for comp in out.outputs:
            assert len(comp.token_ids) == 20 and len(comp.logprobs) == 20
            assert comp.logits_positions == list(range(len(out.prompt_token_ids) - 1, comp.hidden_states.shape[0]))
            # vLLM's raw logprob of each sampled token equals log_softmax of our logits at its row.
            ours = torch.log_softmax(comp.logits, dim=-1)
            for k, tok in enumerate(comp.token_ids):
                assert abs(comp.logprobs[k][tok].logprob - float(ours[k, tok])) < 2e-3
            tokens += assert_sample_matches_hf(model, out, comp)
    assert tokens > 24 * 2 * 140
    assert any(o.outputs[0].token_ids != o.outputs[1].token_ids for o in outs), "samples should differ"


def test_seeded_sampling_with_chunked_prefill_matches_plain_vllm(tap, model):
    """Per-request seeds with prompts longer than a step's token budget (chunked prefill): once an engine
    death on the CPU build. Rows match HF; the outputs equal vLLM's own ``generate`` with the same seeds
    (its prompts then hit the prefix cache: fewer chunks, so the discarded draws of the first run's
    partial prefills must have been undone); another seed samples differently."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": p["token_ids"]} for p in random_prompts(3, [300, 260], seed=21)]
    sp = SamplingParams(max_tokens=12, temperature=0.8, n=2, seed=3, ignore_eos=True)
    ours = tap.generate(prompts, sp)
    plain = tap.llm.generate(prompts, sp, use_tqdm=False)
    other = tap.llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.8, n=2, seed=4, ignore_eos=True),
                             use_tqdm=False)
    for a, b, c in zip(ours, plain, other):
        assert [x.token_ids for x in a.outputs] == [y.token_ids for y in b.outputs]
        assert [x.token_ids for x in a.outputs] != [z.token_ids for z in c.outputs]
        for comp in a.outputs:
            assert_sample_matches_hf(model, a, comp)


def test_greedy_outputs_equal_plain_vllm_and_pre_norm_option(tap, model):
    from vllm import SamplingParams

    prompts = ["def add(a, b):\n    return", "import os\nimport sys\n" * 12, "class Foo(object):" * 10]
    sp = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3)
    ours = tap.generate(prompts, sp, post_norm_last=False, logits_at=[-1])
    plain = tap.llm.generate(prompts, sp, use_tqdm=False)
    for a, b in zip(ours, plain):
        assert a.prompt == b.prompt and a.prompt_token_ids == b.prompt_token_ids
        assert len(a.outputs) == len(b.outputs) == 1
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and ca.text == cb.text and ca.finish_reason == cb.finish_reason
        assert [sorted(d) for d in ca.logprobs] == [sorted(d) for d in cb.logprobs]
        for da, db in zip(ca.logprobs, cb.logprobs):
            for t in da:
                assert abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank
        assert ca.cumulative_logprob == pytest.approx(cb.cumulative_logprob, abs=1e-3)
        assert not hasattr(cb, "hidden_states")
        # post_norm_last=False: plane N is the pre-norm residual stream (HFReference.planes' convention).
        assert_sample_matches_hf(model, a, ca, post_norm=False)
        # logits at the last row: greedy picked their argmax (unless the request stopped at EOS).
        assert ca.logits_positions == [ca.hidden_states.shape[0] - 1]
        assert int(ca.logits[0].argmax()) == ca.token_ids[-1]


def test_rows_reach_this_process_once_at_finish(tap):
    """Memory contract: during a long generation nothing arrives from the engine; one record at finish."""
    from vllm import SamplingParams, TokensPrompt

    engine = tap.llm.llm_engine
    sp = SamplingParams(max_tokens=120, ignore_eos=True)
    sp.extra_args = {"kv_transfer_params": {PARAMS_KEY: {"index": 0, "mode": "generate", "run": tap.run}}}
    engine.add_request("long-gen", TokensPrompt(prompt_token_ids=list(range(10, 60))), sp)
    steps, early = 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        early += len(tap.source.poll(timeout=0.0)) if engine.has_unfinished_requests() else 0
    assert steps >= 60 and early == 0
    got = []
    for _ in range(100):
        got += tap.source.poll(timeout=0.05)
        if got:
            break
    assert len(got) == 1 and got[0].hidden_states.shape[0] == 50 + 120 - 1
    got[0].release()


def test_requests_capture_cannot_serve_are_refused(tap):
    from vllm import SamplingParams

    with pytest.raises(AnalysisError, match="stop strings"):
        tap.generate(["x = 1"], SamplingParams(max_tokens=4, stop=["\n"]))
    with pytest.raises(AnalysisError, match="max_model_len 512"):
        tap.generate([{"prompt_token_ids": list(range(10, 500))}], SamplingParams(max_tokens=22))
    with pytest.raises(AnalysisError, match="logits_at='everything'"):
        tap.generate(["x = 1"], SamplingParams(max_tokens=2), logits_at="everything")
    assert not tap.llm.llm_engine.has_unfinished_requests()


def test_lm_polygraph_adapter_scores_with_layertap_states(tap):
    """Runs where lm-polygraph is installed (a separate venv here: it adds ~60 packages)."""
    pytest.importorskip("lm_polygraph")
    from lm_polygraph.estimators import MeanTokenEntropy
    from lm_polygraph.stat_calculators import EntropyCalculator, VLLMLogprobsExtractionCalculator
    from vllm import SamplingParams

    from layertap.integrations.lm_polygraph import LayertapVLLMWithUncertainty

    m = LayertapVLLMWithUncertainty(tap, [VLLMLogprobsExtractionCalculator(), EntropyCalculator()],
                                    MeanTokenEntropy(), n_logprobs=5)
    res = m.generate(["def f(x):\n", "import os\n"], SamplingParams(max_tokens=8, n=2, temperature=0.8,
                                                                   ignore_eos=True))
    for r in res:
        assert len(r.uncertainty_scores) == 2 and all(s == s for s in r.uncertainty_scores)  # not NaN
        for comp in r.outputs:
            pay = comp.deps["vllm_hidden_states_output"]
            assert pay["layer_ids"] == LAYERS and len(pay["hidden_states"]) == len(LAYERS)
            rows = len(r.prompt_token_ids) + len(comp.token_ids)
            for j, h in enumerate(pay["hidden_states"]):
                assert h.shape == (rows, 128)
                assert torch.equal(h[:-1], comp.hidden_states[:, j]) and not h[-1].any()
