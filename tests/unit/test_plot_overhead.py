"""benchmarks/plot_overhead.py: per-round ratios from both benchmarks' JSON, and a PNG of them."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plot_overhead  # noqa: E402

PREFILL = {"device": "gpu", "args": {"variants": ["plain", "capture"], "prompts": 4, "prompt_len": 8, "hidden": 64,
                                     "num_layers": 2},
           "rows": [{"batch": 1, "plain_rounds": [100.0, 200.0], "capture_rounds": [90.0, 210.0]}]}
SERVE = {"args": {"input_len": 8, "output_len": 4, "hidden": 64, "num_layers": 2},
         "rows": [{"concurrency": 1, "rounds": {
             "plain": [{"output_throughput": 10.0, "median_tpot_ms": 2.0}, {"output_throughput": 20.0, "median_tpot_ms": 1.0}],
             "capture": [{"output_throughput": 9.0, "median_tpot_ms": 2.2}, {"output_throughput": 20.0, "median_tpot_ms": 1.0}]}}]}


def test_ratios_are_per_round_and_the_png_is_written(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(PREFILL))
    (tmp_path / "s.json").write_text(json.dumps(SERVE))
    pre = plot_overhead.panels_of(tmp_path / "p.json")
    assert pre[0]["series"]["capture"] == [("1", [0.9, 1.05])]  # each round over plain in the same round
    thr, tpot = plot_overhead.panels_of(tmp_path / "s.json")
    assert thr["series"]["capture"] == [("1", [0.9, 1.0])]
    assert tpot["series"]["capture"][0][1] == pytest.approx([1.1, 1.0])
    out = tmp_path / "o.png"
    plot_overhead.plot(pre + [thr, tpot], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_other_json_is_refused_by_name(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a capture_overhead or serve_overhead result"):
        plot_overhead.panels_of(tmp_path / "x.json")


def test_runs_stopped_early_still_plot_from_what_they_left(tmp_path):
    """A prefill log cut short (whole rounds only: a round missing a variant is left out) and a serving JSON that
    holds only the raw rounds written after each round."""
    log = "\n".join([
        "--- plain, capture",
        "  round 1/4 in-flight   1                  plain:      100 tok/s (4 pieces)  (occupancy 1.00)",
        "  round 1/4 in-flight   1                capture:       90 tok/s (4 pieces)",
        "  round 2/4 in-flight   1                capture:      210 tok/s",
        "  round 2/4 in-flight   1                  plain:      200 tok/s",
        "  round 1/4 in-flight  16                  plain:      400 tok/s",
        "  round 1/4 in-flight  16                capture:      380 tok/s",
        "  round 2/4 in-flight  16                  plain:      400 tok/s",  # its capture never ran
    ])
    (tmp_path / "c.log").write_text(log)
    (pre,) = plot_overhead.panels_of(tmp_path / "c.log", "4 x 8-token prefill, hidden 64, 2 layers")
    assert pre["series"]["capture"] == [("1", [0.9, 1.05]), ("16", [0.95])]
    assert "hidden 64 x 2 layers" in pre["title"]
    (tmp_path / "s.json").write_text(json.dumps({"args": SERVE["args"], "partial": True, "rounds_done": 2,
                                                 "raw": {v: {"1": rs} for v, rs in SERVE["rows"][0]["rounds"].items()}}))
    thr, _ = plot_overhead.panels_of(tmp_path / "s.json")
    assert thr["series"]["capture"] == [("1", [0.9, 1.0])]
