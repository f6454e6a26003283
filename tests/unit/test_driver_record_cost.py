"""benchmarks/driver_record_cost.py on a real shm pool, small: every record is taken back whole and proven (the
script stops by name otherwise), and each piece of the driver's work is timed."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import driver_record_cost  # noqa: E402


def test_every_piece_is_timed_on_records_taken_back_whole(capsys):
    med = driver_record_cost.main(["--rows", "16", "--layers", "2", "--hidden", "8", "--iters", "5", "--warmup", "1"])
    assert set(med) == {"poll", "expect", "prove", "release", "empty poll", "total"}
    assert all(v > 0 for v in med.values()), med
    assert "ratio to an empty poll" in capsys.readouterr().out
