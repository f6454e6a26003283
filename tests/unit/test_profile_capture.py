"""benchmarks/profile_capture.py: py-spy's raw samples become milliseconds per request per function, and two
variants' profiles are compared thread by thread (matched by process title and thread name, not pid)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_capture as pc  # noqa: E402

ENGINE = 'process {pid}:"VLLM::EngineCore";thread ({tid}): MainThread;run_busy_loop (core.py:10);'
DRIVER = 'process {pid}:"/usr/bin/python3 benchmarks/profile_capture.py --child --variant {v}";thread ({tid}): MainThread;'


def _raw(tmp: Path, name: str, pid: int, v: str, engine: dict[str, int], driver: dict[str, int]) -> Path:
    lines = [ENGINE.format(pid=pid, tid=pid) + f"{stack} {n}" for stack, n in engine.items()]
    lines += [DRIVER.format(pid=pid + 1, tid=pid + 1, v=v) + f"{stack} {n}" for stack, n in driver.items()]
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_counts_and_diff_in_ms_per_request(tmp_path: Path) -> None:
    plain = _raw(tmp_path, "plain.txt", 100, "plain",
                 {"step (core.py:20);execute_model (runner.py:5)": 60, "schedule (sched.py:3)": 10,
                  "get (queue.py:1);wait (threading.py:2)": 30},
                 {"step (llm.py:1);get (queue.py:1)": 90, "add_request (llm.py:9)": 10})
    capture = _raw(tmp_path, "capture.txt", 200, "capture",
                   {"step (core.py:20);execute_model (runner.py:5)": 60,
                    "schedule (sched.py:3);build_connector_meta (connector.py:7)": 20,
                    "get (queue.py:1);wait (threading.py:2)": 20},
                   {"step (llm.py:1);get (queue.py:1)": 80, "_prove (tap.py:4)": 20})
    c = pc.counts(capture)
    engine = c["VLLM::EngineCore | MainThread"]
    assert engine["samples"] == 100
    assert engine["inclusive"]["run_busy_loop (core.py)"] == 100  # once per sample, whatever its depth
    assert engine["inclusive"]["schedule (sched.py)"] == 20
    assert set(c) == set(pc.counts(plain))  # pids and the driver's own arguments are not part of a thread's name
    # 8 rate lines, the first three from before py-spy attached: 10 and 8 requests/s at 1024 tokens each
    rps_a = pc.requests_per_s([1.0, 1.0, 1.0] + [10240.0] * 5, 1024)
    rps_b = pc.requests_per_s([1.0, 1.0, 1.0] + [8192.0] * 5, 1024)
    assert rps_a == pytest.approx(10.0) and rps_b == pytest.approx(8.0)
    side = lambda v, path, rps: {"variant": v, "inflight": 16, "requests_per_s": rps, "threads": pc.counts(path)}
    a, b = side("plain", plain, rps_a), side("capture", capture, rps_b)
    out = pc.diff(json.loads(json.dumps(a)), json.loads(json.dumps(b)))  # as read back from the sidecars
    rows = {ln.split(None, 3)[3]: [float(x) for x in ln.split(None, 3)[:3]] for ln in out.splitlines()
            if ln.startswith("    ")}
    # 100 -> 125 ms per request of wall time; the scheduler's 10% -> 20%: 10 -> 25 ms per request
    assert rows["schedule (sched.py)"] == pytest.approx([10.0, 25.0, 15.0])
    assert rows["build_connector_meta (connector.py)"] == pytest.approx([0.0, 25.0, 25.0])
    assert rows["execute_model (runner.py)"] == pytest.approx([60.0, 75.0, 15.0])
    assert rows["wait (threading.py)"] == pytest.approx([30.0, 25.0, -5.0])
    assert rows["_prove (tap.py)"] == pytest.approx([0.0, 25.0, 25.0])
    assert "VLLM::EngineCore | MainThread" in out and "100.00 -> 125.00" in out.splitlines()[0]
    with pytest.raises(ValueError, match="no request rate"):
        pc.requests_per_s([], 1024)


def test_diff_leaves_out_how_each_run_was_started(tmp_path: Path) -> None:
    """A forked engine core against a spawned one: their entry frames sit on every sample of one run and are
    absent from the other; they say nothing about where time moved and must not crowd out what does."""
    plain = _raw(tmp_path, "plain.txt", 100, "plain",
                 {"popen_fork (fork.py:1);schedule (sched.py:3)": 10, "popen_fork (fork.py:1);step (core.py:20)": 90},
                 {"drive (bench.py:1);get (queue.py:1)": 100})
    capture = _raw(tmp_path, "capture.txt", 200, "capture",
                   {"spawn_main (spawn.py:1);schedule (sched.py:3)": 30, "spawn_main (spawn.py:1);step (core.py:20)": 70},
                   {"tap_loop (tap.py:1);get (queue.py:1)": 100})
    side = lambda v, path: {"variant": v, "inflight": 4, "requests_per_s": 10.0, "threads": pc.counts(path)}
    out = pc.diff(side("plain", plain), side("capture", capture))
    rows = {ln.split(None, 3)[3]: [float(x) for x in ln.split(None, 3)[:3]] for ln in out.splitlines()
            if ln.startswith("    ")}
    assert rows["schedule (sched.py)"] == pytest.approx([10.0, 30.0, 20.0])
    assert rows["step (core.py)"] == pytest.approx([90.0, 70.0, -20.0])
    for entry in ("popen_fork (fork.py)", "spawn_main (spawn.py)", "drive (bench.py)", "tap_loop (tap.py)",
                  "get (queue.py)", "run_busy_loop (core.py)"):
        assert entry not in rows
