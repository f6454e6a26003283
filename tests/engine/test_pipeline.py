"""``layertap train`` end to end on the embedded default (tiny trained target, bundled conversations,
EAGLE-3, shm, CPU vLLM), on a small subset:

1. a run is interrupted with Ctrl-C (SIGINT to its process group) once records flow and a checkpoint
   exists: it exits 130 within a bound, leaves no process and no ``layertap-*`` shared memory behind;
2. ``--resume`` continues it from the checkpoint, captures only the inputs no step consumed, trains to
   the end, evaluates in vLLM and writes the report (acceptance table, rates, idle fraction, PNG).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

pytestmark = pytest.mark.engine

N_INPUTS, BATCH = 40, 4
SMALL = ["--set", f"capture.limit={N_INPUTS}", "--set", "capture.epochs=1", "--set", "capture.max_tokens=32",
         "--set", f"train.batch_size={BATCH}", "--max-steps", str(N_INPUTS // BATCH), "--set", "train.save_every=2",
         "--set", "eval.every=0", "--set", "eval.num_prompts=4", "--set", "eval.max_tokens=16"]


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "layertap", "train", *args]


def _shm(pid: int) -> set[str]:
    """The shm pools process ``pid`` created (pool names carry their creator's pid), so another run on the
    same machine (a second test suite, a demo) cannot make this check pass or fail."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"layertap-{pid}-")}


def _wait(pred, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def _progress(out: Path) -> dict:
    try:
        return json.loads((out / "progress.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _ckpt_consumed(out: Path) -> list[int]:
    sd = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    return list(sd["train_config"]["extra"]["consumed"])


def _launch(out: Path) -> tuple[subprocess.Popen, Any]:
    """Start run 1 of a small ``layertap train`` in its own process group; returns (process, log file)."""
    log = open(out.parent / "run1.log", "w")
    proc = subprocess.Popen(_cmd("--out", str(out), *SMALL), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log


def _running_with_checkpoint(out: Path, proc: subprocess.Popen) -> list[psutil.Process]:
    """Wait until records flow and a checkpoint exists; returns the run's child processes."""
    _wait(lambda: _progress(out).get("step", 0) >= 3 and (out / "checkpoint.pt").exists(), 240,
          "records to flow and a checkpoint", proc)
    return psutil.Process(proc.pid).children(recursive=True)


def _reap(proc: subprocess.Popen, log: Any) -> None:
    """Whatever happened, leave no run behind: kill its process group if it still runs, close its log."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


def _left_behind(kids: list[psutil.Process], timeout: float) -> list[str]:
    """Child processes still alive (not zombies) ``timeout`` s later, as "pid name"; they are then killed."""
    gone = psutil.wait_procs(kids, timeout=timeout)[1]
    left = [f"{p.pid} {p.name()}" for p in gone if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in gone:
        p.kill()
    return left


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Run 1, interrupted by SIGINT after the first checkpoint; returns (out, rc, seconds, leftovers, shm)."""
    out = tmp_path_factory.mktemp("pipeline") / "run"
    proc, log = _launch(out)
    try:
        kids = _running_with_checkpoint(out, proc)
        assert _shm(proc.pid), "the run's shm pool is not named after its pid"
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        rc = proc.wait(timeout=90)
        took = time.monotonic() - t0
    finally:
        _reap(proc, log)
    return out, rc, took, _left_behind(kids, 10), _shm(proc.pid)


def test_sigint_exits_cleanly(interrupted):
    out, rc, took, left, shm = interrupted
    log = (out.parent / "run1.log").read_text()
    assert rc == 130, log[-3000:]
    assert took < 60, f"took {took:.1f}s to stop"
    assert not left, f"processes left behind: {left}"
    assert not shm, f"shared memory left behind: {shm}"
    assert "interrupted" in log


@pytest.fixture(scope="module")
def resumed(interrupted):
    out = interrupted[0]
    before = _ckpt_consumed(out)
    res = subprocess.run(_cmd("--out", str(out), "--resume"), capture_output=True, text=True, timeout=420)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, before, json.loads((out / "report.json").read_text()), res.stdout


def test_resume_feeds_each_input_once(resumed):
    out, before, rep, _ = resumed
    assert before and len(before) % BATCH == 0, before
    assert rep["rates"]["submitted"] == N_INPUTS - len(before)  # consumed inputs were not captured again
    after = _ckpt_consumed(out)
    assert sorted(after) == list(range(N_INPUTS)), after
    assert rep["steps"] == N_INPUTS // BATCH
    # The report covers both invocations: the interrupted one's rates are not lost with it.
    first, second = rep["parts"]
    assert first["status"] == "interrupted" and first["step_from"] == 0 and first["step_to"] >= 3, first
    assert second["status"] == "done" and second["step_from"] == len(before) // BATCH, second
    assert first["rates"]["consumer_records"] >= len(before) > 0
    total = rep["rates_total"]
    assert total["parts"] == 2
    assert total["consumer_records"] == first["rates"]["consumer_records"] + rep["rates"]["consumer_records"]
    assert total["records"] == first["rates"]["records"] + rep["rates"]["records"]


def test_report_has_acceptance_and_rates(resumed):
    out, _, rep, stdout = resumed
    names = [r["name"] for r in rep["acceptance"]["results"]]
    assert names == ["ngram", "eagle3"]
    assert all(r["outputs_match_plain"] for r in rep["acceptance"]["results"])  # greedy spec decode is lossless
    for k in ("producer_records_per_s", "consumer_records_per_s", "producer_tokens_per_s", "trainer_idle_fraction"):
        assert k in rep["rates"]
    assert 0.0 <= rep["rates"]["trainer_idle_fraction"] <= 1.0
    md = (out / "report.md").read_text()
    assert "| eagle3 |" in md and "trainer_idle_fraction" in md
    assert (out / "report.png").stat().st_size > 10_000
    assert (out / "exports" / "final" / "config.json").exists()
    assert "mean acceptance length" in stdout
    # the online head self-test ran on the stream's first records (greedy spans: the target's own tokens)
    st = re.search(r"head self-test \(layer id (\d+)\): greedy-span agreement ([\d.]+) over (\d+) records", stdout)
    assert st is not None, stdout[-3000:]
    assert float(st.group(2)) >= 0.95 and int(st.group(3)) >= 1, st.group(0)


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run whose main process is killed with SIGKILL (no handler runs: what the OOM killer does) after a
    checkpoint; returns (out, leftover processes after 30 s, shm left after 30 s, consumed at the kill)."""
    out = tmp_path_factory.mktemp("pipeline-kill") / "run"
    proc, log = _launch(out)
    try:
        kids = _running_with_checkpoint(out, proc)
        assert _shm(proc.pid), "the run's shm pool is not named after its pid"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        _reap(proc, log)
    left = _left_behind(kids, 30)
    deadline = time.monotonic() + 30
    while _shm(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return out, left, _shm(proc.pid), _ckpt_consumed(out)


def test_sigkill_leaves_nothing_and_resume_finishes(killed):
    """After kill -9 of the main process: its children exit on their own, the shm pool is unlinked (by the
    resource tracker), the last checkpoint is intact (atomic save), and ``--resume`` trains every input
    exactly once to the end."""
    out, left, shm, before = killed
    assert not left, f"processes left behind after kill -9 of the main process: {left}"
    assert not shm, f"shared memory left behind after kill -9: {shm}"
    assert before and len(before) % BATCH == 0, before
    res = subprocess.run(_cmd("--out", str(out), "--resume"), capture_output=True, text=True, timeout=420)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["rates"]["submitted"] == N_INPUTS - len(before)
    assert sorted(_ckpt_consumed(out)) == list(range(N_INPUTS))
    assert rep["steps"] == N_INPUTS // BATCH
    # The killed invocation never wrote its end: the ledger says so instead of dropping it.
    assert [p["status"] for p in rep["parts"]] == ["lost", "done"], rep["parts"]
    assert rep["rates_total"]["parts"] == 1
