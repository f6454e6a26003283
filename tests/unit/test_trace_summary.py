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


def test_decode_steps_and_kernel_diff(tmp_path):
    # Two decode steps per request; engine b runs one extra kernel (a cache write) per step.
    def trace(name, extra):
        events = [_ev("execute_context_1(512)_generation_0(0)", 0, 300),
                  _ev("execute_context_0(0)_generation_1(1)", 400, 40),
                  _ev("execute_context_0(0)_generation_1(1)", 500, 60),
                  _ev("execute_context_0(0)_generation_0(0)", 600, 5),
                  _ev("void flash_fwd_kernel<Traits, true>(Params)", 10, 100, cat="kernel", tid=99, stream=7),
                  _ev("void flash_fwd_kernel<Traits, false>(Params)", 410, 30, cat="kernel", tid=99, stream=7),
                  _ev("void flash_fwd_kernel<Traits, false>(Params)", 510, 30, cat="kernel", tid=99, stream=7)]
        if extra:
            events += [_ev("void reshape_and_cache_flash_kernel<bf16>(int*)", 445, 4, cat="kernel", tid=99, stream=7),
                       _ev("void reshape_and_cache_flash_kernel<bf16>(int*)", 545, 4, cat="kernel", tid=99, stream=7)]
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"traceEvents": events}))
        return trace_summary.summarize(path)

    a, b = trace("a", False), trace("b", True)
    assert a["decode_steps_per_request"] == 2.0  # the empty step is not a decode step
    assert a["decode_step_ms_median"] == 0.05
    assert a["top_kernels_ms_per_request"] == {"flash_fwd_kernel": 0.16}  # template variants merged
    assert abs(b["kernel_ms_per_request"] - a["kernel_ms_per_request"] - 0.008) < 1e-12
    diff = trace_summary.kernel_diff(a, b).splitlines()
    assert diff[2].split()[0] == "reshape_and_cache_flash_kernel" and diff[2].split()[-1] == "+0.008"
    assert "decode steps" in trace_summary.compare({"a": a, "b": b})


def test_steps_by_how_full_they_were(tmp_path):
    events = [_ev("execute_context_2(2048)_generation_0(0)", 0, 100), _ev("execute_context_2(2048)_generation_0(0)", 200, 300),
              _ev("execute_context_4(4096)_generation_0(0)", 600, 500), _ev("execute_context_0(0)_generation_0(0)", 1200, 10)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = trace_summary.summarize(path, requests=8)
    assert s["step_sizes"] == {"execute_context_0(0)": [1, 0.01], "execute_context_2(2048)": [2, 0.2],
                               "execute_context_4(4096)": [1, 0.5]}
