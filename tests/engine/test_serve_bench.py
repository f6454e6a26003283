"""``benchmarks/serve_overhead.py`` end to end on the CPU build, small: ``layertap serve --capture-all`` and
``vllm serve`` started side by side (two capture servers: the default hook, FULL CUDA graphs kept, and the floor: the same engine and connector
reading no rows), each driven by vLLM's own load generator (``vllm bench serve``) at two
concurrencies. The GPU serving measurement (issue 15, ``scripts/gpu_check.sh serve``) is this same script;
here it must finish with every request's record counted and a sample of the served records recomputed by
HF. No speed is asserted (that is the benchmark's job on the GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]


def test_serving_benchmark_counts_every_record_and_verifies_a_sample(tmp_path):
    out = tmp_path / "serve_overhead.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_overhead.py"), "--hidden", "64", "--num-layers", "4",
           "--head-dim", "32", "--input-len", "48", "--output-len", "16", "--concurrency", "1,4",
           "--prompts-per-concurrency", "2", "--min-prompts", "6", "--rounds", "1", "--verify", "3",
           "--start-timeout", "300", "--bench-timeout", "300", "--variants", "plain,capture,floor",
           "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (r.stdout[-4000:] + "\n" + r.stderr[-4000:])
    assert r.returncode == 0, tail
    rep = json.loads(out.read_text())
    assert [row["concurrency"] for row in rep["rows"]] == [1, 4], rep["rows"]
    for row in rep["rows"]:
        assert sorted(row["variants"]) == ["capture", "floor"], row
        cap, floor = row["variants"]["capture"], row["variants"]["floor"]
        # every request the capture server finished (the load generator's warm-ups too) left one record; the
        # floor server (capture engine, connector, no reads) served as many and wrote none
        assert cap["requests"] >= 6 and cap["records"] == cap["requests"], cap
        assert floor["requests"] == 0 and floor["records"] == 0, floor
        assert (row["rounds"]["floor"][0]["server_requests"] == row["rounds"]["capture"][0]["server_requests"]), row
        for v, e in row["variants"].items():
            assert e["throughput_ratio"] > 0 and e["output_throughput"] > 0, (v, e)
        for v in ("plain", "capture", "floor"):
            (run,) = row["rounds"][v]
            assert run["completed"] == run["num_prompts"] and run["output_throughput"] > 0, (v, run)
            assert run["median_tpot_ms"] > 0 or run["server_tpot_ms"] > 0, (v, run)
    ver = rep["verified"]
    assert ver["ok"] and ver["records"] == 3, ver
    assert ver["tokens"] > 3 * 16, ver  # generate mode: the prompt's rows and every generated token's
    assert "serving overhead on cpu" in r.stdout, tail
