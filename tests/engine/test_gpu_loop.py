"""``benchmarks/gpu_loop.py`` end to end with its CPU profile (``cpu-tiny``): the same code the H200 run
takes, with real vLLM CPU engines and tiny sizes. The target is the CPU main job's (cached under
``LAYERTAP_CACHE``); two ``layertap train`` runs at once (EAGLE-3 with a periodic evaluation, DFlash), the
offline capture + ``train-offline`` on half the inputs, four serving engines (plain, ngram, EAGLE-3, DFlash) at batch 1 and 4, and the
report. About 14 CPU engine start-ups: several minutes on 2 cores.

Also: a second call finds every stage done and only rewrites the report (the GPU run resumes this way over
several device calls), and a deadline that leaves no room stops before the first stage with exit 75.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_loop.py"
BATCHES = ["1", "4"]  # the cpu-tiny profile's serving batch sizes


def _loop(work: Path, out: Path, *extra: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--profile", "cpu-tiny", "--work", str(work),
                           "--out", str(out), *extra], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _why(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stdout (tail)\n{p.stdout[-6000:]}\n--- stderr (tail)\n{p.stderr[-3000:]}"


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    base = tmp_path_factory.mktemp("gpu_loop")
    work, out = base / "work", base / "out"
    p = _loop(work, out)
    assert p.returncode == 0, _why(p)
    return work, out, json.loads((out / "gpu_loop.json").read_text())


def _positive(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_summary_has_every_required_number(loop: tuple[Path, Path, dict]) -> None:
    _, _, j = loop
    assert j["complete"] is True and j["failures"] == {}, j["failures"]
    assert j["batch_sizes"] == BATCHES
    for name in ("eagle3", "dflash", "ngram"):
        s = j[name]
        assert isinstance(s["acceptance_length"], float) and s["acceptance_length"] >= 1.0, (name, s)
        assert sorted(s["speedup"]) == BATCHES and all(_positive(v) for v in s["speedup"].values()), (name, s)
        eq = s["outputs_equal_plain"]
        assert sorted(eq) == BATCHES and all(0.0 <= v <= 1.0 for v in eq.values()), (name, eq)
        assert all(_positive(v) for v in s["output_tokens_per_s"].values()), (name, s)
        assert s["model_runner"] in ("V1", "V2")
    assert all(_positive(v) for v in j["plain"]["output_tokens_per_s"].values())
    assert j["plain"]["speedup"] == {b: 1.0 for b in BATCHES}


def test_serving_is_paired_and_greedy_outputs_equal_plain(loop: tuple[Path, Path, dict]) -> None:
    """All four engines alive at once, timed in two interleaved rounds: each speed-up is the median of two
    per-round ratios. In float32 (the CPU profile) speculative decoding must not change a greedy output."""
    work, _, j = loop
    log = (work / "gpu_loop.log").read_text()
    for name in ("ngram", "eagle3", "dflash"):
        rounds = j[name]["speedup_by_round"]
        assert sorted(rounds) == BATCHES and all(len(r) == 2 for r in rounds.values()), (name, rounds)
        for b in BATCHES:
            lo, hi = j[name]["speedup_range"][b]
            assert lo <= j[name]["speedup"][b] <= hi and [lo, hi] == [min(rounds[b]), max(rounds[b])]
        assert j[name]["outputs_equal_plain"] == {b: 1.0 for b in BATCHES}, (name, j[name]["outputs_equal_plain"])
    assert j["plain_batch_invariance"] == {b: 1.0 for b in BATCHES}
    assert "4 engines starting at once" in log and "serve round 2/2 b=4" in log
    assert set(j["goals"]) == {"eagle3_speedup_b1_ge_1.5", "eagle3_above_ngram_everywhere", "outputs_equal_plain_all"}


def test_serving_profile_margins_and_engine_facts(loop: tuple[Path, Path, dict]) -> None:
    """The untimed extras after the rounds: EAGLE-3's engine profiled at batch 1 (the profile's
    serve_profile), plain's top-2 margins (its margin run reproduces its timed batch-1 outputs; no variant
    diverges from it in float32), and each engine's start-up facts read from its log."""
    _, out, j = loop
    prof = j["serve_profiles"]
    assert list(prof) == ["eagle3"], prof
    sm = prof["eagle3"]["summary"]
    assert "error" not in sm and sm["window_ms_per_request"] > 0 and sm["top_cpu_ops_ms_per_request"], sm
    assert prof["eagle3"]["output_tokens"] > 0 and prof["eagle3"]["acceptance_length"] >= 1.0
    assert j["margin_run_equals_plain_b1"] == 1.0
    div = j["divergence_from_plain_b1"]
    assert set(div) == {"plain", "ngram", "eagle3", "dflash"}, div
    for v, by in div.items():
        assert sorted(by) == BATCHES and all(d["compared"] == 2 and d["diverged"] == 0 for d in by.values()), (v, by)
    facts = j["engine_log_facts"]
    assert set(facts) == {"plain", "ngram", "eagle3", "dflash"}
    assert any("eagle3" in f.lower() or "speculative" in f.lower() for f in facts["eagle3"]), facts["eagle3"]
    assert "Outputs that differ from plain's batch-1 output" in (out / "gpu_loop.md").read_text()


def test_training_runs_report_rates_curves_and_target(loop: tuple[Path, Path, dict]) -> None:
    _, _, j = loop
    assert math.isfinite(j["target"]["final_loss"]) and j["target"]["parameters"] > 0
    for kind in ("eagle3", "dflash"):
        t = j[kind]["train"]
        assert t["steps"] == 6 and math.isfinite(t["final_loss"]), t
        assert 0.0 <= t["trainer_idle_fraction"] <= 1.0
        assert _positive(t["trainer_tokens_per_s"]) and _positive(t["records_per_s"])
        assert t["mfu"] is None  # CPU: no peak FLOP/s to divide by
        assert t["train_eval_acceptance_length"] >= 1.0 and t["transport"] == "shm"
        assert len(t["loss_curve"]) == 6
    steps = [s for s, _ in j["eagle3"]["train"]["acceptance_curve"]]
    assert steps == [3, 6], "EAGLE-3's periodic evaluation (step 3) and the final one"
    off = j["offline"]  # the first 16 of the 32 training conversations (offline_records): 4 steps of 4
    assert off["dataset_records"] == off["inputs"] == 16 and off["steps"] == off["max_steps"] == 4, off
    assert off["dataset_bytes"] > 0 and off["online_inputs"] >= 24
    assert off["offline_dataset_bytes_at_online_size"] > off["dataset_bytes"]
    assert _positive(off["capture_wall_s"]) and _positive(off["train_wall_s"]) and _positive(off["online_wall_s"])
    assert _positive(off["offline_total_s_per_1k"]) and _positive(off["online_span_s_per_1k"])


def test_drafter_stages_ran_at_once(loop: tuple[Path, Path, dict]) -> None:
    """parallel_drafters: both ``layertap train`` runs were alive together (each stage's start is logged
    before either ends), and each kept its own compile cache."""
    work, out, _ = loop
    log = (out / "gpu_loop.log").read_text().splitlines()
    assert any("eagle3 and dflash: at once" in x for x in log), log[:20]
    first_end = min(i for i, x in enumerate(log) if x.split("] ", 1)[-1].startswith(("eagle3: exit", "dflash: exit")))
    starts = [i for i, x in enumerate(log) if x.split("] ", 1)[-1] in ("eagle3: start", "dflash: start")]
    assert len(starts) == 2 and max(starts) < first_end, log
    assert (work / "vllm-cache" / "train-eagle3").is_dir() and (work / "vllm-cache" / "train-dflash").is_dir()


def test_report_files(loop: tuple[Path, Path, dict]) -> None:
    work, out, _ = loop
    png = (out / "gpu_loop.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = (out / "gpu_loop.md").read_text()
    assert "| eagle3 |" in md and "speed-up b=4" in md
    assert (work / "report" / "gpu_loop.json").exists() and (out / "gpu_loop.log").exists()


def test_second_call_resumes_with_nothing_left(loop: tuple[Path, Path, dict]) -> None:
    work, out, j = loop
    p = _loop(work, out, timeout=120)
    assert p.returncode == 0, _why(p)
    # nothing started again: no stage subprocess ("NAME: exit N after Ns") and no serving engine
    assert ": exit " not in p.stdout, p.stdout
    assert "engines starting at once" not in p.stdout
    for stage in ("target", "eagle3", "dflash", "offline", "serve"):
        assert f"{stage}: done earlier, skipped" in p.stdout
    again = json.loads((out / "gpu_loop.json").read_text())
    assert again["eagle3"]["speedup"] == j["eagle3"]["speedup"] and again["invocations"] == 2


def test_deadline_stops_before_a_stage_that_does_not_fit(tmp_path: Path) -> None:
    p = _loop(tmp_path / "work", tmp_path / "out", "--deadline-s", "5", timeout=120)
    assert p.returncode == 75, _why(p)
    assert "target: deferred: target needs" in p.stdout and "eagle3: deferred: waits for the target" in p.stdout
    j = json.loads((tmp_path / "out" / "gpu_loop.json").read_text())
    assert j["complete"] is False and j["stages_done"] == []
