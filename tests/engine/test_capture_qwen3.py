"""Capture on a uniform full-attention model (Qwen3: the capture layer is merged into the attention
group), under concurrency, chunked prefill, prefix caching, over-length inputs, aborts and generation.
One engine for the module; every record is checked against HF transformers."""

import pytest

from layertap.data import InputError
from layertap.engine.connector import PARAMS_KEY
from layertap.models.tiny import tiny_model
from layertap.tap import Tap

from .helpers import BASE, assert_all_match, metric, random_prompts

pytestmark = pytest.mark.engine
LAYERS = [0, 1, 2, 4]


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def tap(model):
    # max_num_batched_tokens 128 is far below the longest prompt (~500): chunked prefill on every long one.
    t = Tap(model=model, layers=LAYERS, **{**BASE, "max_model_len": 512}, max_num_seqs=80,
            max_num_batched_tokens=128, enable_prefix_caching=True)
    yield t
    t.close()


def test_many_concurrent_requests_of_very_different_lengths(tap, model):
    lengths = [3, 17, 64, 129, 250, 500, 1, 77, 300, 9]
    inputs = random_prompts(72, lengths, seed=1)
    recs = list(tap.capture(inputs))
    assert sorted(r.index for r in recs) == list(range(72))
    for r in recs:
        assert r.token_ids.tolist() == inputs[r.index]["token_ids"]
        assert r.hidden_states.shape == (len(inputs[r.index]["token_ids"]), len(LAYERS), 128)
        assert r.layer_ids == LAYERS and r.mode == "prompt"
    assert_all_match(recs, model)


def test_requests_built_ahead_carry_their_own_marker_and_match_hf(tap, model):
    """With ``Tap.prebuild`` the Tap builds the next requests while the engine runs (``compat.request_builder``):
    the seam must exist on this vLLM, and requests built ahead from one shared params template must each keep
    their own input's marker (else the proof fails by index). Built at admission (the default), the same
    inputs give the same rows."""
    import torch

    from layertap.engine import compat

    assert compat.request_builder(tap.llm.llm_engine, tap.version) is not None, "no request-building seam"
    inputs = random_prompts(20, [30, 7, 120, 61], seed=21)
    tap.max_inflight = 3  # three built ahead at a time, admitted one and two at a time
    tap.prebuild = True
    try:
        ahead = {r.index: r for r in tap.capture(inputs)}
        tap.prebuild = False
        at_admission = {r.index: r for r in tap.capture(inputs)}
    finally:
        tap.prebuild, tap.max_inflight = False, None
    assert sorted(ahead) == sorted(at_admission) == list(range(20))
    for i, r in ahead.items():
        assert r.token_ids.tolist() == inputs[i]["token_ids"]
        assert torch.allclose(r.hidden_states, at_admission[i].hidden_states, atol=1e-5)
    assert_all_match(list(ahead.values()), model)


def test_the_engine_output_waiting_in_the_driver_is_seen(tap):
    """The seam the Tap's record deferral reads: the CPU build's engine core runs in its own process, and
    its output shows in the driver's queue before ``step`` takes it."""
    import time

    from vllm import SamplingParams, TokensPrompt

    from layertap.engine import compat

    waiting = compat.output_waiting_check(tap.llm)
    assert waiting is not None, "the multiprocess engine client's output queue was not found"
    engine = tap.llm.llm_engine
    while engine.has_unfinished_requests() or waiting():  # an earlier capture's last outputs (its saves' step)
        engine.step()
    engine.add_request("seen-waiting", TokensPrompt(prompt_token_ids=[11, 12, 13]), SamplingParams(max_tokens=1))
    deadline = time.monotonic() + 60
    while not waiting():
        assert time.monotonic() < deadline, "the engine's output never reached the driver's queue"
        time.sleep(0.002)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs if o.finished] == ["seen-waiting"]


def test_records_wait_while_engine_output_does_and_all_are_proven(tap, model):
    """A slow consumer: it holds each record until the engine's next output waits in the driver (or nothing
    runs), so the Tap must take that output before handing out the round's other records (``deferrals``);
    every record still comes, right."""
    import time

    from layertap.engine import compat

    waiting = compat.output_waiting_check(tap.llm)
    engine = tap.llm.llm_engine
    inputs = random_prompts(24, [40, 90, 20], seed=11)
    before = tap.deferrals
    tap.max_inflight = 8
    recs = []
    try:
        for rec in tap.capture(inputs):
            deadline = time.monotonic() + 60
            while not waiting() and engine.has_unfinished_requests():
                assert time.monotonic() < deadline, "no engine output within 60 s while requests ran"
                time.sleep(0.001)
            recs.append(rec)
    finally:
        tap.max_inflight = None
    assert sorted(r.index for r in recs) == list(range(24))
    assert tap.deferrals > before, "no record waited for an engine output"
    assert_all_match(recs, model)


class _OutputsAfterRecords:
    """Stands in for ``tap.step`` and forces the order CUDA gives: a request's record lands before its finished
    output reaches the driver. Each step result that finishes requests is held back until their records are
    committed in the pool, and an empty result goes first; the held result comes on the next call.
    ``seen``: finished outputs handed to the Tap so far."""

    def __init__(self, tap):
        self.real, self.pool = tap.step, tap.source.pool
        self.committed = self.pool.commit_seq()  # one sequence number per committed record (CPU commits)
        self.held: list = []
        self.seen = 0

    def __call__(self):
        import time

        if self.held:
            outs = list(self.held)
            self.held.clear()
            self.seen += sum(1 for o in outs if o.finished)
            return outs
        outs = self.real()
        done = sum(1 for o in outs if o.finished)
        if not done:
            return outs
        self.committed += done
        deadline = time.monotonic() + 60
        while self.pool.commit_seq() < self.committed:
            assert time.monotonic() < deadline, f"{done} finished requests' records never committed"
            time.sleep(0.005)
        self.held.extend(outs)
        return []


def test_a_record_in_hand_is_handed_out_without_waiting_for_more(tap, model):
    """A request's record can land before its finished output reaches the driver (on CUDA a prompt's record
    is copied out in its own forward step). Once the output comes, the Tap hands that record out at once: it
    does not first wait for more records (it did: the full wait, 50 ms, at the end of every capture call on
    the H100, 2026-12-05). Forced here: each step result that finishes requests is held back until their
    records are committed in the pool, and an empty result goes first, so the Tap takes the records before
    it learns their requests finished. No wait may then come back empty."""
    real_poll = tap.source.poll
    step = _OutputsAfterRecords(tap)
    empty_waits: list[float] = []

    def poll(timeout: float = 0.0):
        recs = real_poll(timeout)
        if timeout > 0 and not recs:
            empty_waits.append(timeout)
        return recs

    inputs = random_prompts(6, [30, 70], seed=5)
    tap.step, tap.source.poll = step, poll
    tap.max_inflight = 1
    try:
        recs = list(tap.capture(inputs))
    finally:
        del tap.step, tap.source.poll
        tap.max_inflight = None
    assert sorted(r.index for r in recs) == list(range(6))
    assert not step.held
    assert empty_waits == [], f"the Tap waited for records {len(empty_waits)} times with its record in hand"
    assert_all_match(recs, model)


def test_records_of_running_requests_stay_in_the_pool_until_their_requests_finish(tap, model):
    """The Tap takes records off the pool only where one can be due (a finished request awaits its record) or
    nothing runs. A record that lands while its request still runs (on CUDA a prompt's record lands in its own
    forward step, before the finished output reaches the driver) stays in the pool until the output came:
    taking it earlier is driver work in the way of the engine's next output. Forced as in the test above: each
    step result that finishes requests is held back until their records are committed and an empty result
    goes first; no poll may come while every finished request's record is already taken (before 2026-12-06 the
    Tap took them on every round: one such poll per request)."""
    real_poll = tap.source.poll
    step = _OutputsAfterRecords(tap)
    taken = 0  # records the Tap took off the pool (step.seen: finished outputs handed to it)
    early_polls: list[tuple[int, int]] = []

    def poll(timeout: float = 0.0):
        nonlocal taken
        if step.seen == taken:  # no finished request awaits a record; one runs (max_inflight 1, a roomy pool)
            early_polls.append((step.seen, taken))
        recs = real_poll(timeout)
        taken += len(recs)
        return recs

    inputs = random_prompts(5, [30, 70], seed=7)
    tap.step, tap.source.poll = step, poll
    tap.max_inflight = 1
    try:
        recs = list(tap.capture(inputs))
    finally:
        del tap.step, tap.source.poll
        tap.max_inflight = None
    assert sorted(r.index for r in recs) == list(range(5))
    assert not step.held and step.seen == taken == 5
    assert early_polls == [], f"the Tap took records off the pool {len(early_polls)} times with none due"
    assert_all_match(recs, model)


def test_successors_wait_in_the_engine_where_it_runs_at_most_max_inflight(tap, model):
    """Where the engine's max_num_seqs is at most ``max_inflight``, the Tap keeps as many again waiting in the
    engine's queue (``Tap.lookahead``): the engine replaces a finished request itself, with no round trip
    through the driver. The engine's bound is read from the running engine (80 here); it is stood in for by 2,
    so that the Tap's count of requests in the engine must reach 4. With lookahead off it never passes 2."""
    assert tap._engine_seqs == 80, "the Tap did not read the engine's max_num_seqs"
    engine = tap.llm.llm_engine
    real_add, real_step = engine.add_request, tap.step
    inputs = random_prompts(12, [20, 90], seed=31)
    peaks = {}
    for lookahead in (True, False):
        in_engine, peak = 0, 0

        def add(*a, **k):
            nonlocal in_engine, peak
            in_engine += 1
            peak = max(peak, in_engine)
            return real_add(*a, **k)

        def step():
            nonlocal in_engine
            outs = real_step()
            in_engine -= sum(o.finished for o in outs)
            return outs

        engine.add_request, tap.step = add, step
        tap.max_inflight, tap._engine_seqs, tap.lookahead = 2, 2, lookahead
        try:
            recs = list(tap.capture(inputs))
        finally:
            del engine.add_request, tap.step
            tap.max_inflight, tap._engine_seqs, tap.lookahead = None, 80, True
        assert sorted(r.index for r in recs) == list(range(12))
        assert_all_match(recs, model)
        peaks[lookahead] = peak
    assert peaks == {True: 4, False: 2}, peaks


def test_prefix_caching_hits_are_captured_right(tap, model):
    prefixes = random_prompts(3, [260], seed=2)
    suffixes = random_prompts(30, [5, 40, 90], seed=3)
    inputs = [{"token_ids": prefixes[i % 3]["token_ids"] + s["token_ids"]} for i, s in enumerate(suffixes)]
    hits_before = metric(tap.llm, "vllm:prefix_cache_hits")
    first = list(tap.capture(inputs[:3]))  # computes the prefixes
    rest = list(tap.capture(inputs))  # every one shares a 260-token prefix: cache hits
    hits = metric(tap.llm, "vllm:prefix_cache_hits") - hits_before
    assert hits >= 27 * 128, f"expected prefix-cache hits on the shared prefixes, got {hits} tokens"
    assert_all_match(first + rest, model)


def test_over_length_input_is_rejected_and_the_rest_proceed(tap, model):
    ok = random_prompts(4, [20, 200], seed=4)
    edge = random_prompts(1, [512 - 2], seed=5)[0]  # prompt + 1 sampled + 1 capture slot == max_model_len
    too_long = random_prompts(1, [512 - 1], seed=6)[0]
    before = len(tap.rejected)
    recs = list(tap.capture(ok + [too_long, edge]))
    rejected = tap.rejected[before:]
    assert [r.index for r in rejected] == [4]
    assert "max_model_len 512" in rejected[0].reason and "input 4" in rejected[0].reason
    assert sorted(r.index for r in recs) == [0, 1, 2, 3, 5]
    assert_all_match(recs, model)


def test_inputs_past_the_first_round_are_checked_and_rejected_too(tap, model):
    # max_inflight 1: one input is checked before the first admission, the others while it runs
    ok = random_prompts(4, [20, 200], seed=14)
    too_long = random_prompts(1, [512 - 1], seed=15)[0]
    before = len(tap.rejected)
    tap.max_inflight = 1
    try:
        recs = list(tap.capture(ok[:2] + [too_long] + ok[2:]))
    finally:
        tap.max_inflight = None
    assert [r.index for r in tap.rejected[before:]] == [2]
    assert sorted(r.index for r in recs) == [0, 1, 3, 4]
    assert_all_match(recs, model)


def test_a_bad_input_past_the_first_round_stops_the_call_before_any_record(tap, model):
    good = random_prompts(6, [100, 300], seed=11)
    tap.max_inflight = 2
    n0 = tap._n_req
    got = []
    try:
        with pytest.raises(InputError, match=r"input 6: token ids \[1000000000\] are outside the vocabulary"):
            for rec in tap.capture(good + [{"token_ids": [5, 10**9]}]):
                got.append(rec)
    finally:
        tap.max_inflight = None
    assert got == [], "no record may be handed out when an input is bad"
    assert tap._n_req - n0 == 2, "the first round's two requests went to the engine before the rest was checked"
    recs = list(tap.capture(random_prompts(4, [50], seed=12)))  # their aborted requests confuse nothing
    assert sorted(r.index for r in recs) == list(range(4))
    assert_all_match(recs, model)


def test_a_file_dataset_gets_no_record_from_a_call_with_a_bad_input(model, tmp_path):
    # records written to disk as requests finish: every input is checked before any request goes in
    with Tap(model=model, layers=LAYERS, **{**BASE, "max_model_len": 512}, out=tmp_path / "ds") as t:
        t.max_inflight = 1
        with pytest.raises(InputError, match=r"input 3: token ids \[1000000000\] are outside the vocabulary"):
            list(t.capture(random_prompts(3, [50], seed=16) + [{"token_ids": [5, 10**9]}]))
        assert t._n_req == 0, "no request may reach the engine before every input is checked"
        recs = list(t.capture(random_prompts(2, [50], seed=17)))
        assert sorted(r.index for r in recs) == [0, 1]
    lines = [ln for f in (tmp_path / "ds").glob("index-*.jsonl") for ln in f.read_text().splitlines() if ln.strip()]
    assert len(lines) == 2, lines


def test_generate_mode_rows_cover_prompt_and_generated_tokens(tap, model):
    from vllm import SamplingParams

    inputs = random_prompts(12, [5, 60, 130], seed=7)
    # Unseeded sampling: the rows must match HF for whatever was sampled (seeds: the next test).
    sp = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
    recs = list(tap.capture(inputs, mode="generate", sampling_params=sp))
    assert len(recs) == 12
    for r in recs:
        p = len(inputs[r.index]["token_ids"])
        assert r.num_prompt_tokens == p
        assert r.hidden_states.shape[0] == p + 24 - 1  # the last sampled token never ran
        assert r.token_ids[:p].tolist() == inputs[r.index]["token_ids"]
        assert r.meta["next_token_id"] is not None
    assert_all_match(recs, model)


def test_seeded_sampling_with_chunked_prefill(tap, model):
    """A per-request seed with prompts prefilled in several chunks (300 tokens, 128 per step) once killed
    the CPU engine ("CPU Generator does not use offset"). Now: rows match HF, and a rerun whose prompts
    hit the prefix cache (fewer chunks, so no discarded draws) samples the same tokens: the discarded
    draws of the partial prefills were undone, as on CUDA."""
    from vllm import SamplingParams

    inputs = random_prompts(4, [300, 270], seed=41)
    sp = SamplingParams(max_tokens=16, temperature=0.8, seed=3, ignore_eos=True)
    first = {r.index: r for r in tap.capture(inputs, mode="generate", sampling_params=sp)}
    again = {r.index: r for r in tap.capture(inputs, mode="generate", sampling_params=sp)}
    other = {r.index: r for r in tap.capture(inputs, mode="generate",
                                             sampling_params=SamplingParams(max_tokens=16, temperature=0.8, seed=4,
                                                                            ignore_eos=True))}
    assert sorted(first) == sorted(again) == sorted(other) == [0, 1, 2, 3]
    for i in first:
        assert first[i].token_ids.tolist() == again[i].token_ids.tolist(), f"input {i}: seed 3 sampled differently"
    assert any(first[i].token_ids.tolist() != other[i].token_ids.tolist() for i in first), "seeds 3 and 4 agree"
    assert_all_match(list(first.values()) + list(other.values()), model)


def test_aborted_request_leaves_no_record_and_no_blocks(tap, model):
    from vllm import SamplingParams, TokensPrompt

    engine = tap.llm.llm_engine
    sp = SamplingParams(max_tokens=200, ignore_eos=True)
    sp.extra_args = {"kv_transfer_params": {PARAMS_KEY: {"index": 999, "mode": "generate", "run": tap.run}}}
    engine.add_request("abort-me", TokensPrompt(prompt_token_ids=list(range(10, 150))), sp)
    for _ in range(3):
        engine.step()
    engine.abort_request(["abort-me"])
    while engine.has_unfinished_requests():
        engine.step()
    # A stray record for index 999 would make this capture raise "matches no request of this run".
    recs = list(tap.capture(random_prompts(4, [30], seed=8)))
    assert sorted(r.index for r in recs) == [0, 1, 2, 3]
    assert not [p for p in tap.source.poll(timeout=1.0)], "a record arrived for the aborted request"
    # The usage gauge is refreshed per engine step: run one plain 1-token request (no capture), whose own
    # block is then the only one in use. Anything above one block is a leak.
    engine.add_request("drain", TokensPrompt(prompt_token_ids=[11]), SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    blocks = next(int(m.labels["num_gpu_blocks"]) for m in tap.llm.get_metrics()
                  if m.name == "vllm:cache_config_info")
    used = metric(tap.llm, "vllm:kv_cache_usage_perc") * blocks
    assert used <= 1.0 + 1e-6, f"{used:.1f} KV blocks still in use after the abort and all captures"


def test_conversations_carry_loss_masks(tap, model):
    from layertap.data import conversation_tokens

    convs = [[{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "    return a + b"}],
             [{"role": "user", "content": "import os"}, {"role": "assistant", "content": "import sys"},
              {"role": "user", "content": "and?"}, {"role": "assistant", "content": "import re"}]]
    recs = sorted(tap.capture(convs), key=lambda r: r.index)
    for r, c in zip(recs, convs):
        ids, mask = conversation_tokens(tap.tokenizer, c)
        assert r.token_ids.tolist() == ids
        assert r.loss_mask.tolist() == mask and sum(mask) > 0
    assert_all_match(recs, model)


def test_leaving_a_capture_early_does_not_confuse_the_next(tap, model):
    it = tap.capture(random_prompts(40, [100, 300], seed=9))
    first = [next(it), next(it)]
    it.close()  # the caller stops iterating with requests still in flight
    recs = list(tap.capture(random_prompts(6, [50], seed=10)))
    assert sorted(r.index for r in recs) == list(range(6))
    assert_all_match(first + recs, model)


def test_default_hook_path_runs_without_speculative_decoding(tap):
    cfg = tap.llm.llm_engine.vllm_config
    assert tap.capture_path == "hook"
    assert cfg.speculative_config is None
    assert cfg.parallel_config.worker_cls == "layertap.engine.hook_worker.LayertapWorker"


def test_extract_path_records_match_hf_too(model):
    """The other capture path (vLLM's extract_hidden_states) on the same workload shapes: concurrency,
    chunked prefill, prefix-sharing prompts."""
    inputs = random_prompts(10, [3, 64, 300], seed=31)
    shared = [{"token_ids": inputs[2]["token_ids"] + p["token_ids"]} for p in random_prompts(4, [5, 40], seed=32)]
    with Tap(model=model, layers=LAYERS, capture_path="extract", **{**BASE, "max_model_len": 512},
             max_num_batched_tokens=128, enable_prefix_caching=True) as t:
        assert t.llm.llm_engine.vllm_config.speculative_config.method == "extract_hidden_states"
        recs = list(t.capture(inputs)) + list(t.capture(shared))
    assert len(recs) == 14
    assert_all_match(recs, model)


def test_capture_path_settings_are_checked():
    from layertap.engine import launch

    with pytest.raises(ValueError, match="unknown capture path"):
        launch.engine_capture_kwargs("hooks", [1], {})
    with pytest.raises(ValueError, match="worker_cls is set by layertap"):
        launch.engine_capture_kwargs("hook", [1], {"worker_cls": "my.Worker"})
    with pytest.raises(ValueError, match="speculative_config is set by layertap"):
        launch.engine_capture_kwargs("extract", [1], {"speculative_config": {"method": "ngram"}})
    assert launch.engine_capture_kwargs("hook", [1], {"worker_cls": "auto"}) == {"worker_cls": launch.HOOK_WORKER}


def test_a_model_vllm_cannot_tap_is_refused_by_name_before_the_engine_starts(tmp_path):
    """OPT runs in vLLM but its implementation has no residual-stream (EAGLE-3 aux) outputs."""
    from transformers import OPTConfig, OPTForCausalLM

    from layertap.engine.compat import UnsupportedVLLM

    cfg = OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2, vocab_size=64,
                    max_position_embeddings=64, word_embed_proj_dim=32)
    OPTForCausalLM(cfg).save_pretrained(tmp_path / "opt")
    with pytest.raises(UnsupportedVLLM, match="OPTForCausalLM.*cannot tap it"):
        Tap(model=tmp_path / "opt", layers=[1, 2], transport="file", out=tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written for a run that cannot start
