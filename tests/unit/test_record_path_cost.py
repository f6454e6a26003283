"""benchmarks/record_path_cost.py on the CPU: the worker's real record path (here its CPU branch) into a real
shm pool, every record taken off the pool and proven by token digest; and the pair mode against another
checkout (this one), whose ratio table comes from child processes. And benchmarks/handover_cost.py, the record
process hand-over, with the real process."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import handover_cost  # noqa: E402
import record_path_cost  # noqa: E402


def test_steps_run_and_every_record_arrives():
    rows = record_path_cost.main(["--iters", "4", "--warmup", "1", "--records", "1,3"])
    assert [r["records"] for r in rows] == [1, 3]
    assert all(r["rounds"] == 4 and r["step_us"] > 0 for r in rows)


def test_pair_against_a_baseline_tree(tmp_path, capsys):
    out = tmp_path / "pair.json"
    rows = record_path_cost.main(["--iters", "3", "--warmup", "1", "--records", "2", "--baseline-tree", str(ROOT),
                                  "--rounds", "1", "--json", str(out)])
    assert len(rows) == 1 and rows[0]["records"] == 2 and rows[0]["ratio"] > 0
    assert out.exists() and "this / baseline" in capsys.readouterr().out


def test_handover_cost_times_the_real_record_process_and_every_record_arrives():
    """benchmarks/handover_cost.py: the real record process (host staging ring) takes each step's descriptor and
    commits its records before the next step is timed (a lost record ends the run by name)."""
    rows = handover_cost.main(["--records", "1,3", "--steps", "4", "--tokens", "64"])
    assert [r["records"] for r in rows] == [1, 3]
    assert all(r["pickle_us"] > 0 and r["send_us"] > 0 and r["steps"] == 4 for r in rows), rows
