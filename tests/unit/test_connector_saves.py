"""When the connector's scheduler side issues saves (no engine: the scheduler output is built here with the
attributes vLLM's SchedulerOutput carries; the engine tests run the same code against the real engine and
check every record against HF)."""

from types import SimpleNamespace as NS

import numpy as np

from layertap.engine.saves import PARAMS_KEY, SchedulerSide


def side(path="hook"):
    c = NS(_group=0, _layer_ids=[1, 2], _group_desc={}, _check_steps=0,
           _extra={"capture_path": path, "default_mode": "prompt"})
    return SchedulerSide(c)


def new(rid, prompt, blocks, computed=0, mode="prompt"):
    sp = NS(extra_args={"kv_transfer_params": {PARAMS_KEY: {"index": 7, "mode": mode, "run": "r"}}})
    return NS(req_id=rid, prompt_token_ids=prompt, sampling_params=sp, block_ids=(blocks,), num_computed_tokens=computed)


def out(new_reqs=(), cached=(), sched=None):
    c = NS(req_ids=[r[0] for r in cached], new_block_ids=[r[1] for r in cached], resumed_req_ids=set(),
           num_computed_tokens=[r[2] for r in cached], num_output_tokens=[r[3] for r in cached])
    return NS(scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=c, num_scheduled_tokens=dict(sched or {}))


def request(rid, prompt, generated=(), status="RequestStatus.FINISHED_LENGTH_CAPPED"):
    return NS(request_id=rid, kv_transfer_params=None, status=status, prompt_token_ids=prompt,
              all_token_ids=list(prompt) + list(generated), num_computed_tokens=len(prompt) + max(0, len(generated) - 1))


PROMPT = list(range(100, 250))  # 150 tokens, block size irrelevant here


def test_prompt_mode_is_saved_in_the_step_that_completes_the_prompt():
    s = side()
    m1 = s.build_meta(out([new("a", PROMPT, [3, 4])], sched={"a": 100}))  # first chunk
    assert m1.saves == []
    m2 = s.build_meta(out(cached=[("a", ([5],), 100, 0)], sched={"a": 50}))  # last chunk
    assert [j.req_id for j in m2.saves] == ["a"]
    job = m2.saves[0]
    assert job.release is False and job.num_rows == 150 and job.block_ids == [3, 4, 5]
    assert list(job.token_ids) == PROMPT and "token_digest" not in job.meta  # the record's writer hashes them
    # async scheduling may schedule it once more before it is known finished: no second save
    assert s.build_meta(out(cached=[("a", None, 150, 1)], sched={"a": 1})).saves == []
    hold, params = s.finished(request("a", PROMPT, [9]), [3, 4, 5])
    assert hold is False  # nothing to wait for: the blocks go back at once
    assert params[PARAMS_KEY]["status"] == "saving" and params[PARAMS_KEY]["key"] == job.key
    assert "token_digest" not in params[PARAMS_KEY]  # none to report: the writer hashes, the Tap checks the record
    assert s.build_meta(out()).saves == []


def test_generate_mode_waits_for_the_finished_request():
    s = side()
    assert s.build_meta(out([new("g", PROMPT, [1, 2], mode="generate")], sched={"g": 150})).saves == []
    hold, params = s.finished(request("g", PROMPT, [9, 10, 11]), [1, 2])
    assert hold is True and params[PARAMS_KEY]["num_rows"] == 152
    (job,) = s.build_meta(out()).saves
    assert job.release is True and list(job.token_ids) == PROMPT + [9, 10] and job.meta["next_token_id"] == 11


def test_extract_path_saves_after_the_request_finishes():
    """On the extract path the rows are written by the drafter after the forward: never saved early."""
    s = side("extract")
    assert s.build_meta(out([new("x", PROMPT, [1, 2])], sched={"x": 150})).saves == []
    hold, _ = s.finished(request("x", PROMPT, [9]), [1, 2])
    assert hold is True and [j.release for j in s.build_meta(out()).saves] == [True]


def test_abort_after_an_early_save_reports_aborted():
    s = side()
    assert len(s.build_meta(out([new("a", PROMPT, [1, 2])], sched={"a": 150})).saves) == 1
    hold, params = s.finished(request("a", PROMPT, status="RequestStatus.FINISHED_ABORTED"), [1, 2])
    assert hold is False and params[PARAMS_KEY]["status"] == "aborted"


def test_steady_state_steps_skip_block_tracking_but_keep_every_save():
    """Once no slot check can come and no prompt waits for an early save, a step only hands out the saves
    queued by request_finished (no per-request pass on the engine's thread); a prompt-mode request arriving
    later is tracked again, chunk by chunk, and saved with all of its blocks."""
    c = NS(_group=0, _layer_ids=[1, 2], _group_desc={}, _check_steps=2,
           _extra={"capture_path": "hook", "default_mode": "generate"})
    s = SchedulerSide(c)
    s.build_meta(out([new("g", PROMPT, [1, 2], mode="generate")], sched={"g": 150}))
    for k in range(2):  # the first decode steps still carry slot checks for the generate-mode request
        m = s.build_meta(out(cached=[("g", None, 150 + k, 1 + k)], sched={"g": 1}))
        assert [ch.req_id for ch in m.checks] == ["g"]
    m = s.build_meta(out(cached=[("g", ([3],), 152, 3)], sched={"g": 1}))
    assert m.checks == [] and m.saves == []
    assert s.blocks["g"] == [1, 2]  # steady state: not tracked (its save takes request_finished's ids)
    hold, _ = s.finished(request("g", PROMPT, [9, 10, 11]), [1, 2, 3])
    (job,) = s.build_meta(out(cached=[("h", None, 10, 2)], sched={"h": 1})).saves
    assert hold is True and job.block_ids == [1, 2, 3] and job.num_rows == 152
    # a prompt-mode request now: tracked over its two chunks, saved early with every block
    assert s.build_meta(out([new("p", PROMPT, [7, 8], mode="prompt")], sched={"p": 100})).saves == []
    (early,) = s.build_meta(out(cached=[("p", ([9],), 100, 0)], sched={"p": 50})).saves
    assert early.req_id == "p" and early.block_ids == [7, 8, 9] and early.release is False
    assert s.build_meta(out(cached=[("p", None, 150, 1)], sched={"p": 1})).saves == []


def test_a_prompt_only_run_reaches_the_steady_state_without_decode_checks():
    """Prompt-mode requests keep no decode rows, so no decode-step check can come while only they run: the
    steady state starts once the first steps' checks are done (before, a prompt-only run took the full pass on
    every step, since its decode checks never ran). A generate-mode request arriving later is checked on its
    first decode steps again, and its blocks tracked meanwhile."""
    c = NS(_group=0, _layer_ids=[1, 2], _group_desc={}, _check_steps=2,
           _extra={"capture_path": "hook", "default_mode": "prompt"})
    s = SchedulerSide(c)
    for k, rid in enumerate("ab"):  # the first two steps carry checks
        m = s.build_meta(out([new(rid, PROMPT, [2 * k + 1, 2 * k + 2])], sched={rid: 150}))
        assert [ch.req_id for ch in m.checks] == [rid] and [j.req_id for j in m.saves] == [rid]
        s.finished(request(rid, PROMPT, [9]), [2 * k + 1, 2 * k + 2])
    s.build_meta(out([new("c", PROMPT, [5, 6])], sched={"c": 150}))  # saved early, still running
    m = s.build_meta(out(cached=[("c", ([7],), 150, 1)], sched={"c": 1}))  # one more step before it is known finished
    assert m.checks == [] and m.saves == [] and s.blocks["c"] == [5, 6]  # steady state: not tracked
    s.finished(request("c", PROMPT, [9]), [5, 6, 7])
    # a generate-mode request: its decode steps are checked and its blocks followed until those checks ran
    s.build_meta(out([new("g", PROMPT, [8, 9], mode="generate")], sched={"g": 150}))
    m = s.build_meta(out(cached=[("g", ([10],), 150, 1)], sched={"g": 1}))
    assert [ch.req_id for ch in m.checks] == ["g"] and s.blocks["g"] == [8, 9, 10]
    hold, _ = s.finished(request("g", PROMPT, [9, 10]), [8, 9, 10])
    assert hold is True and not s.gen_live
    (job,) = s.build_meta(out()).saves
    assert job.block_ids == [8, 9, 10]
