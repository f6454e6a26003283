"""A resumed ``layertap train`` run reports all of itself: the parts ledger (one entry per invocation, a
killed one marked ``lost``), rates summed over the parts, and the earlier invocations' evaluations kept in
the acceptance curve. (The real interrupted-and-resumed run: tests/engine/test_pipeline.py.)"""

from __future__ import annotations

import json

import pytest

from layertap.pipeline.config import PipelineConfig
from layertap.pipeline.evaluate import EvalRunner
from layertap.pipeline.report import combine_rates
from layertap.pipeline.run import PARTS, Parts, start_run_dir


def _rates(records, prod_wall, tokens, cons, cons_wall, cons_tokens, idle, wait=0.0):
    return {"submitted": records, "records": records, "rejected": 0, "retried": 0, "producer_wall_s": prod_wall,
            "producer_records_per_s": round(records / prod_wall, 2), "producer_tokens_per_s": round(tokens / prod_wall, 1),
            "producer_tokens": tokens, "consumer_records": cons, "consumer_wall_s": cons_wall,
            "consumer_records_per_s": round(cons / cons_wall, 2), "consumer_tokens_per_s": round(cons_tokens / cons_wall, 1),
            "consumer_tokens": cons_tokens, "trainer_startup_wait_s": wait, "trainer_idle_s": idle,
            "trainer_idle_fraction": round(idle / cons_wall, 4)}


def test_combine_rates_sums_parts_and_recomputes_rates():
    a = _rates(1000, 20.0, 400_000, 960, 25.0, 380_000, 5.0, wait=100.0)
    b = _rates(200, 10.0, 80_000, 240, 5.0, 100_000, 1.0, wait=40.0)
    eval_only = _rates(0, 0.01, 0, 0, 1e-9, 0, 0.0)  # the invocation that only ran the final evaluation
    t = combine_rates([{"rates": a}, {"status": "lost"}, {"rates": b}, {"rates": eval_only}])
    assert t["records"] == 1200 and t["consumer_records"] == 1200 and t["parts"] == 3
    assert t["producer_records_per_s"] == pytest.approx(1200 / 30.01, abs=0.01)
    assert t["consumer_tokens_per_s"] == pytest.approx(480_000 / 30.0, abs=0.1)
    assert t["trainer_idle_fraction"] == pytest.approx(6.0 / 30.0, abs=1e-4)
    assert t["trainer_startup_wait_s"] == 140.0
    assert combine_rates([{"status": "lost"}]) == {}
    # one part: its own numbers
    assert combine_rates([{"rates": a}])["consumer_records_per_s"] == a["consumer_records_per_s"]


def test_parts_ledger_marks_a_killed_part_lost(tmp_path):
    p1 = Parts(tmp_path, 0)
    p1.end("interrupted", 7, {"records": 3})
    Parts(tmp_path, 6)  # resumed from the step-6 checkpoint, then killed: no end()
    p3 = Parts(tmp_path, 6)
    parts = p3.end("done", 12, {"records": 5})
    assert [p["status"] for p in parts] == ["interrupted", "lost", "done"]
    assert [p["step_from"] for p in parts] == [0, 6, 6] and parts[0]["step_to"] == 7
    assert json.loads((tmp_path / PARTS).read_text()) == parts
    (tmp_path / PARTS).write_text("{not json")
    with pytest.raises(RuntimeError, match="not valid JSON"):
        Parts(tmp_path, 0)


def test_a_fresh_run_starts_a_new_ledger(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / PARTS).write_text(json.dumps([{"part": 1, "status": "interrupted"}]))
    start_run_dir(PipelineConfig(out=str(out)), resume=True)
    assert (out / PARTS).exists()
    start_run_dir(PipelineConfig(out=str(out)), resume=False)  # no checkpoint there: a new run
    assert not (out / PARTS).exists()


def test_eval_runner_keeps_earlier_evaluations(tmp_path):
    ev = EvalRunner(tmp_path, "target", [[1, 2]], max_tokens=4, ngram_k=3, kv_cache_mb=64)

    def job(step, baseline=False, result=True):
        (ev.dir / f"job-{step}.json").write_text(json.dumps({"step": step, "baseline": baseline}))
        if result:
            (ev.dir / f"result-{step}.json").write_text(json.dumps({"step": step, "results": []}))

    job(4)
    job(8, result=False)  # its invocation ended while it ran
    job(10, baseline=True, result=False)  # an interrupted final evaluation
    job(16)  # past the resume step: the resumed run evaluates it again
    job(20)  # the last step: left to the final evaluation
    ev.load_earlier(12, 20)
    assert [r["step"] for r in ev.results] == [4]
    assert ev.skipped == [8]
