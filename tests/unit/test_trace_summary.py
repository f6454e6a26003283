"""benchmarks/trace_summary.py on a hand-made trace: the per-request numbers the GPU profile tables rest on
(steps, empty steps, time between steps, the busiest thread, GPU busy time)."""

import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import trace_summary  # noqa: E402


def _ev(name, ts, dur, cat="user_annotation", tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "pid": 7, "tid": tid, "args": args}


def test_steps_empty_steps_and_gaps(tmp_path):
    # Two requests: each a 1024-token step (100 us) then an empty step (10 us); outside the steps the
    # engine sits 60 us in all (10 + 40 + 10). One kernel of 50 us per request.
    events = [
        _ev("execute_context_1(1024)_generation_0(0)", 0, 100),
        _ev("execute_context_0(0)_generation_0(0)", 110, 10),
        _ev("execute_context_1(1024)_generation_0(0)", 160, 100),
        _ev("execute_context_0(0)_generation_0(0)", 270, 10),
        _ev("aten::mm", 5, 20, cat="cpu_op"),
        _ev("gemm", 20, 50, cat="kernel", tid=99, stream=7),
        _ev("gemm", 180, 50, cat="kernel", tid=99, stream=7),
        {"ph": "i", "name": "marker", "ts": 3},  # not a complete event: ignored
    ]
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = trace_summary.summarize(path, requests=2)
    assert s["window_ms_per_request"] == 0.14  # 280 us over 2 requests
    assert s["steps_per_request"] == 2.0
    assert s["empty_steps_per_request"] == 1.0
    assert s["empty_step_ms_per_request"] == 0.01
    assert s["between_steps_ms_per_request"] == 0.03  # (280 - 220) us / 2
    assert abs(s["gpu_busy_fraction"] - 100 / 280) < 1e-9
    assert s["kernels_per_request"] == 1.0
    table = trace_summary.compare({"a": s, "b": {**s, "empty_steps_per_request": 0.0}})
    assert "empty steps" in table and "between steps ms" in table
    assert "busiest CPU thread ms" in table


def test_trace_without_step_annotations(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([_ev("aten::mm", 0, 10, cat="cpu_op")]))
    s = trace_summary.summarize(path)
    assert s["steps_per_request"] == 0 and s["between_steps_ms_per_request"] is None
