"""The Tap over an engine core in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the step-cost
benchmark and single-process debugging run it). Such a core steps only when called, so the Tap must keep
stepping while records are owed: in generate mode the step that hands the last finished requests to the
connector's save comes after the one they finished in (seen: the last record of a run never arrived and
the Tap raised MissingRecords). With prefix caching off, the engine core makes no block hasher for the
capture engine (``compat.skip_request_block_hashes``), and the records stay right. Runs in a child process,
since the setting is read when vLLM starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from vllm import SamplingParams
from layertap.models.tiny import tiny_model
from layertap.tap import Tap
from layertap.engine import compat
from tests.engine.helpers import BASE, assert_all_match, random_prompts

model = tiny_model("qwen3")
inputs = random_prompts(5, [7, 40], seed=31)
out = {}
with Tap(model=model, layers=[1, 2, 4], **BASE, record_timeout=30) as tap:
    out["in_process"] = compat.engine_core_in_process(tap.llm)
    out["hasher_with_prefix_caching"] = tap.llm.llm_engine.engine_core.engine_core.request_block_hasher is not None
    for inflight in (1, 3):  # the last request finishes alone, and with others
        tap.max_inflight = inflight
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        recs = list(tap.capture(inputs, mode="generate", sampling_params=sp))
        out[f"rows@{inflight}"] = sorted((r.index, r.hidden_states.shape[0] - len(inputs[r.index]["token_ids"]))
                                         for r in recs)
        assert_all_match(recs, model)
        prompt = list(tap.capture(inputs[:2]))  # prompt mode after it, on the same engine
        out[f"prompt@{inflight}"] = sorted(r.index for r in prompt)
# Prefix caching off: the engine core computes no block hashes for the capture engine (the connector reads
# rows by block id), and the records are still right.
with Tap(model=model, layers=[1, 2, 4], **{**BASE, "enable_prefix_caching": False}, record_timeout=30) as tap:
    out["hasher_without_prefix_caching"] = tap.llm.llm_engine.engine_core.engine_core.request_block_hasher is not None
    recs = list(tap.capture(inputs, mode="generate", sampling_params=SamplingParams(max_tokens=6, temperature=0.0,
                                                                                    ignore_eos=True)))
    assert_all_match(recs, model)
    out["no_prefix_caching"] = sorted(r.index for r in recs)
out["quiet_patched"] = list(compat._QUIET_EMPTY)
out["quiet_counts"] = dict(compat.QUIET_EMPTY_COUNTS)
print("RESULT " + json.dumps(out))
"""


def test_generate_mode_over_an_in_process_engine_core_delivers_every_record():
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(line[0][len("RESULT "):])
    assert out["in_process"] is True
    # the block hasher exists where prefix caching needs it, and not where only layertap's connector would
    assert out["hasher_with_prefix_caching"] is True and out["hasher_without_prefix_caching"] is False
    assert out["no_prefix_caching"] == list(range(5)), out
    for inflight in (1, 3):
        # every input's record, each with its prompt's rows and 6 - 1 generated ones (the last never ran)
        assert out[f"rows@{inflight}"] == [[i, 5] for i in range(5)], out
        assert out[f"prompt@{inflight}"] == [0, 1], out
    # The worker skips vLLM's connector round on steps with no forward and nothing for it; the generate-mode
    # saves that go out in such steps (a request's save follows the step it finished in) went through it, and
    # every record above matched HF
    assert out["quiet_patched"], out
    assert out["quiet_counts"]["through"] > 0, out
