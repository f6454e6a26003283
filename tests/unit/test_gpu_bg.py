"""scripts/gpu_bg.sh: a job started in its own process session outlives the call that started it; its PRE
step runs at once, the job itself only after vLLM's install marker where a bundle is being delivered;
`wait` reports 75 while it runs, then the job's own status, with $BG/out copied out. Real processes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_bg.sh"


def _run(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _env(tmp_path: Path, *, bundle: bool, install_wait_s: int = 120, pre: str = "") -> dict[str, str]:
    home = tmp_path / "home"
    (home / "vllm-bundle" if bundle else home).mkdir(parents=True)
    return {**os.environ, "HOME": str(home), "BG_DIR": str(tmp_path / "bg"), "OUT": str(tmp_path / "out"),
            "INSTALL_WAIT_S": str(install_wait_s), "PRE": pre}


pytestmark = pytest.mark.usefixtures("stop_detached")  # tests/unit/conftest.py


def test_job_waits_for_install_then_reports_its_status(tmp_path: Path) -> None:
    env = _env(tmp_path, bundle=True, pre='echo built > "$OUT/pre.txt"')
    assert _run(env, "wait", "1").returncode == 3  # nothing started: said, not a hang
    job = 'echo "a b" > "$OUT/job.txt"; exit 4'  # quoting survives; the job's own status comes back
    started = _run(env, "start", job)
    assert started.returncode == 0, started.stdout + started.stderr
    pid = int((tmp_path / "bg" / "pid").read_text())
    assert os.getsid(pid) == pid  # a session of its own: a device call's end does not stop it
    waiting = _run(env, "wait", "2")
    assert waiting.returncode == 75, waiting.stdout
    out = tmp_path / "out"
    assert (out / "pre.txt").read_text() == "built\n"  # PRE ran without vLLM
    assert not (out / "job.txt").exists()  # the job waits for the install marker
    (tmp_path / "home" / "vllm-site").mkdir()
    (tmp_path / "home" / "vllm-site" / ".installed").touch()
    done = _run(env, "wait", "30")
    assert done.returncode == 4, done.stdout
    assert (out / "job.txt").read_text() == "a b\n"
    assert "the job ended with status 4" in (out / "gpu_bg.log").read_text()


def test_no_bundle_runs_at_once_and_a_missing_install_is_named(tmp_path: Path) -> None:
    env = _env(tmp_path / "a", bundle=False)
    assert _run(env, "start", 'echo ok > "$OUT/x"').returncode == 0
    assert _run(env, "wait", "30").returncode == 0
    assert (tmp_path / "a" / "out" / "x").read_text() == "ok\n"
    env = _env(tmp_path / "b", bundle=True, install_wait_s=1)
    assert _run(env, "start", "true").returncode == 0
    res = _run(env, "wait", "30")
    assert res.returncode == 2 and "vLLM not installed after 1 s" in res.stdout


def test_start_needs_one_command_line(tmp_path: Path) -> None:
    env = _env(tmp_path, bundle=False)
    assert _run(env, "start").returncode == 2
    assert _run(env, "start", "a", "b").returncode == 2


def test_wait_brings_everything_back_within_the_device_calls_file_limit(tmp_path: Path) -> None:
    """A device call returns at most 8 files, two folders down: `wait` packs what the job wrote into one
    archive (torch traces aside) and puts the newest top-level files beside it, 8 files in all."""
    import tarfile

    env = _env(tmp_path, bundle=False)
    job = ('for i in 1 2 3 4 5 6 7 8 9; do echo $i > "$OUT/f$i.log"; done; mkdir -p "$OUT/a/b/c"; '
           'echo deep > "$OUT/a/b/c/r.json"; echo t > "$OUT/x.pt.trace.json.gz"')
    assert _run(env, "start", job).returncode == 0
    assert _run(env, "wait", "30").returncode == 0
    out = tmp_path / "out"
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    with tarfile.open(out / "bg_out.tgz") as t:
        names = {n.lstrip("./") for n in t.getnames()}
    assert {f"f{i}.log" for i in range(1, 10)} | {"a/b/c/r.json"} <= names
    assert "x.pt.trace.json.gz" not in names
    assert (out / "gpu_bg.log").exists() and (out / "f9.log").read_text() == "9\n"


def test_stop_ends_the_whole_job_and_a_killed_driver_is_named_at_once(tmp_path: Path) -> None:
    """`stop` ends the job's process session (the driver and what it started), so a new job can start at once;
    a driver killed from outside leaves no status, and `wait` says so at once instead of waiting out its limit
    (2026-12-07: a lease's last 540 s went to a `wait` on a driver that a stray kill had ended)."""
    import time

    env = _env(tmp_path, bundle=False)
    assert _run(env, "stop").returncode == 3  # nothing started: said
    assert _run(env, "start", 'sleep 300 & echo $! > "$OUT/child"; wait').returncode == 0
    for _ in range(100):
        if (tmp_path / "bg" / "out" / "child").exists():
            break
        time.sleep(0.1)
    child = int((tmp_path / "bg" / "out" / "child").read_text())
    stopped = _run(env, "stop")
    assert stopped.returncode == 0 and "stopped job" in stopped.stdout, stopped.stdout
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)  # the job's own child went with it
    assert _run(env, "start", 'echo again > "$OUT/y"').returncode == 0
    assert _run(env, "wait", "30").returncode == 0
    assert (tmp_path / "out" / "y").read_text() == "again\n"

    assert _run(env, "start", "sleep 300").returncode == 0
    pid = int((tmp_path / "bg" / "pid").read_text())
    os.killpg(pid, 9)
    t0 = time.monotonic()
    res = _run(env, "wait", "120")
    assert res.returncode == 4 and "left no status" in res.stdout, res.stdout
    assert time.monotonic() - t0 < 30
