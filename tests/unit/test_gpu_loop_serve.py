"""The serve stage's pure parts (benchmarks/gpu_loop.py, layertap.pipeline.evaluate): variant names and
their speculative configs, where an output first diverges from plain's and plain's top-2 margin there, the
logprob reading behind those margins, and the engine facts taken from a worker's log. The engines
themselves run in tests/engine/test_gpu_loop.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_loop  # noqa: E402

from layertap.pipeline.evaluate import _top2, first_divergence  # noqa: E402


def _run(tmp_path: Path) -> SimpleNamespace:
    for kind in ("eagle3", "dflash"):
        d = tmp_path / kind / "exports" / "final"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"layertap": {"kind": kind}, "block_size": 8}))
    return SimpleNamespace(profile=gpu_loop.H200, work=tmp_path)


def test_variant_names_and_their_configs(tmp_path: Path) -> None:
    run = _run(tmp_path)
    spec, env, why = gpu_loop.serve_spec(run, "eagle3")
    assert why is None and env == {} and spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 4
    spec, env, _ = gpu_loop.serve_spec(run, "eagle3-k2")
    assert spec["num_speculative_tokens"] == 2 and spec["model"] == str(tmp_path / "eagle3/exports/final")
    spec, env, _ = gpu_loop.serve_spec(run, "eagle3-v1")
    assert env == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and spec["num_speculative_tokens"] == 4
    assert gpu_loop.serve_spec(run, "dflash")[0]["num_speculative_tokens"] == 7  # B - 1
    assert gpu_loop.serve_spec(run, "dflash-k3")[0]["num_speculative_tokens"] == 3
    assert gpu_loop.serve_spec(run, "plain-v1") == (None, {"VLLM_USE_V2_MODEL_RUNNER": "0"}, None)
    spec, _, why = gpu_loop.serve_spec(run, "eagle3-offline")
    assert spec is None and "no exported drafter" in why
    for bad in ("eagle3-k0", "eagle3-kx", "medusa", "ngram-k2"):
        assert not gpu_loop.known_variant(bad), bad
    with pytest.raises(ValueError, match="unknown variant"):
        gpu_loop.serve_spec(run, "medusa-k2")
    assert all(gpu_loop.known_variant(v) for v in gpu_loop.H200.serve_variants)
    assert gpu_loop.variant_drafter("eagle3-k2") == "eagle3" and gpu_loop.variant_drafter("plain") is None


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1, 2, 3], [1, 2]) == 2


def test_divergences_place_each_difference_at_plains_margin() -> None:
    ref = {"outputs": [[1, 2, 3], [4, 5, 6], [7, 8, 9]],
           "top2": [[[2.0, 9], [0.01, 7], [1.0, 0]], [[3.0, 1], [3.0, 1], [3.0, 1]], [[0.5, 1], [0.5, 1], [0.2, 4]]]}
    d = gpu_loop.divergences([[1, 7, 0], [4, 5, 6], [7, 8, 3]], ref)
    assert d["compared"] == 3 and d["diverged"] == 2
    assert [(r["prompt"], r["position"], r["margin"], r["took_runner_up"]) for r in d["rows"]] == [
        (0, 1, 0.01, True), (2, 2, 0.2, False)]
    assert d["max_margin"] == 0.2 and d["runner_up_share"] == 0.5
    short = gpu_loop.divergences([[1, 2], [4, 5, 6], [7, 8, 9]], ref)  # a prefix of plain's: still diverged
    assert short["diverged"] == 1 and short["length_only"] == 1 and short["max_margin"] is None
    assert short["runner_up_share"] is None and short["rows"][0]["position"] == 2
    none = gpu_loop.divergences([[1, 2, 3]], ref)
    assert none["diverged"] == 0 and none["max_margin"] is None and none["compared"] == 1


def _lp(**d: float) -> dict[int, SimpleNamespace]:
    return {int(k[1:]): SimpleNamespace(logprob=v) for k, v in d.items()}


def test_top2_reads_margin_and_runner_up() -> None:
    rows = _top2([_lp(t5=-0.1, t6=-2.6), _lp(t3=-1.0, t4=-1.0)], [5, 3])
    assert rows == [[pytest.approx(2.5), 6], [0.0, 4]]
    with pytest.raises(RuntimeError, match="not the top one"):
        _top2([_lp(t5=-3.0, t6=-0.5)], [5])
    with pytest.raises(RuntimeError, match="logprob positions"):
        _top2(None, [5])
    with pytest.raises(RuntimeError, match="1 logprobs, not 2"):
        _top2([_lp(t5=-0.1)], [5])


def test_engine_log_facts(tmp_path: Path) -> None:
    log = tmp_path / "serve-eagle3.log"
    log.write_text("==== 2026-12-01T10:00:00 serve worker eagle3\n"
                   "INFO 12-01 10:00:00 [vllm.py:1] Asynchronous scheduling is enabled.\n"
                   "INFO 12-01 10:00:01 [vllm.py:1] Asynchronous scheduling is enabled.\n"
                   "INFO 12-01 10:00:02 [gpu.py:2] Capturing CUDA graphs (decode, FULL): 100%\n"
                   "Capturing CUDA graphs (FULL):  43%|####      | 3/7 [00:00<00:00, 25.04it/s]\n"
                   "(EngineCore pid=1)     _draft_kernel         0.00%       0.000us       0.00%     466\n"
                   "INFO 12-01 10:00:03 [loader.py:3] Loading weights took 0.5 s\n"
                   "INFO 12-01 10:00:04 [core.py:4] Initializing a V1 LLM engine with config: model='m', "
                   + "x" * 400 + " compilation_config={'level': 3, 'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: "
                   "(2, 1)>, 'use_inductor': True}\n"
                   + gpu_loop.SERVE_MSG + '{"ready": true, "speculative": 1}\n')
    assert gpu_loop.engine_log_facts(log) == ["Asynchronous scheduling is enabled.",
                                              "Capturing CUDA graphs (decode, FULL): 100%",
                                              "Initializing a V1 LLM engine with config: model='m', " + "x" * 247,
                                              "'cudagraph_mode': <CUDAGraphMode.FULL_AND_PIECEWISE: (2"]
    assert gpu_loop.engine_log_facts(tmp_path / "absent.log") == []


def test_overrides_for_a_longer_eagle3_run() -> None:
    p = gpu_loop.apply_overrides(gpu_loop.H200, ['drafter_steps={"eagle3": 2304}', "convs=18592",
                                                 'serve_variants=["plain", "eagle3", "eagle3-k3"]'])
    assert gpu_loop.steps_of(p, "eagle3") == 2304 and gpu_loop.steps_of(p, "dflash") == p.steps == 768
    sets = gpu_loop.train_sets(p, "eagle3")
    assert sets["train.max_steps"] == 2304 and sets["train.log_every"] == 230
    assert gpu_loop.train_sets(p, "dflash")["train.max_steps"] == 768
    assert p.convs == 18592 and p.serve_variants == ("plain", "eagle3", "eagle3-k3")
    with pytest.raises(SystemExit, match="drafter_steps"):
        gpu_loop.apply_overrides(gpu_loop.H200, ['drafter_steps={"medusa": 10}'])


def test_merge_memory_keeps_every_calls_peaks():
    """A drafter stage resumed over two device calls reports the higher device peak and every process."""
    a = {"device_peak_used_mib": 39000, "device_total_mib": 143771, "processes": {"11": {"peak_mib": 9990}}}
    b = {"device_peak_used_mib": 29000, "device_total_mib": 143771, "processes": {"42": {"peak_mib": 1392}}}
    m = gpu_loop.merge_memory([a, None, b])
    assert m["device_peak_used_mib"] == 39000 and set(m["processes"]) == {"11", "42"} and m["calls"] == 2
    assert gpu_loop.merge_memory([a]) is a and gpu_loop.merge_memory([None]) is None


@pytest.mark.parametrize("name", sorted(gpu_loop.PROFILES))
def test_profile_recipes_hold_together(name: str) -> None:
    """Each profile's numbers agree with each other: one pass of fresh conversations feeds every drafter's
    steps, the capture engine runs as many requests as the Tap admits, and the shm pool holds that many
    records of 512 tokens (so the pool, not max_inflight, never silently sets the producer's pace)."""
    p = gpu_loop.PROFILES[name]
    for kind in gpu_loop.DRAFTERS:
        assert (p.convs - p.holdout) * p.epochs >= gpu_loop.steps_of(p, kind) * p.batch, kind
    if "max_num_seqs" in p.engine:
        assert p.engine["max_num_seqs"] >= p.max_inflight
    record = 512 * 4 * p.target.model.hidden_size * 2  # 4 captured layers, 16-bit
    slots_per_record = -(-record // (p.shm_slot_mb << 20))
    assert p.shm_slots >= p.max_inflight * slots_per_record
    assert all(gpu_loop.known_variant(v) for v in p.serve_variants)
    assert set(p.serve_prompts) == set(p.serve_batches) and p.holdout >= max(p.serve_prompts.values())


def test_h200_eagle3_profile_is_the_measured_recipe() -> None:
    """The named recipe is what the 2026-12-03 loop8 run passed as overrides (RESULTS.md): the same profile."""
    p = gpu_loop.apply_overrides(gpu_loop.H200, [
        "convs=55456", 'drafter_steps={"eagle3":6912}', 'eval_every={"eagle3":3456,"dflash":384}',
        "max_inflight=256", "shm_slots=1024", "save_every=576",
        'engine={"gpu_memory_utilization":0.2,"max_model_len":1024,"max_num_seqs":256,'
        '"kv_cache_memory_bytes":25769803776}', 'serve_prompts={"1":32,"8":64,"32":160}', "serve_repeats=6"])
    q = gpu_loop.PROFILES["h200-eagle3"]
    assert gpu_loop.train_sets(p, "eagle3") == gpu_loop.train_sets(q, "eagle3")
    assert (p.serve_prompts, p.serve_repeats, p.serve_batches) == (q.serve_prompts, q.serve_repeats, q.serve_batches)
    assert q.serve_variants == ("plain", "ngram", "eagle3") and q.target == gpu_loop.H200.target
