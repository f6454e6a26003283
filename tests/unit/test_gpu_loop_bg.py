"""scripts/gpu_loop_bg.sh: the loop started in its own process session outlives the call that started it,
waits for vLLM's install marker before the stages that need it, and `wait` reports 75 while it runs, then the
loop's own status, with the results copied out. Without a bundle being delivered ($HOME/vllm-bundle) it
waits for nothing: a machine with vLLM installed runs the loop at once. Real processes; the cpu-tiny
profile's report stage stands in for the loop's stages (it needs no engine)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_loop_bg.sh"


def _run(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _env(tmp_path: Path, install_wait_s: int, *, bundle: bool) -> dict[str, str]:
    """The environment of a run under tmp_path (home, bg, out, cache); ``bundle``: a vLLM bundle is being
    delivered ($HOME/vllm-bundle exists, as on the lent machine)."""
    home = tmp_path / "home"
    (home / "vllm-bundle" if bundle else home).mkdir(parents=True)
    return {**os.environ, "HOME": str(home), "BG_DIR": str(tmp_path / "bg"), "OUT": str(tmp_path / "out"),
            "PROFILE": "cpu-tiny", "LAYERTAP_CACHE": str(tmp_path / "cache"), "INSTALL_WAIT_S": str(install_wait_s),
            "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}


pytestmark = pytest.mark.usefixtures("stop_detached")  # tests/unit/conftest.py


def test_detached_loop_waits_for_install_and_reports(tmp_path: Path) -> None:
    home, bg, out = tmp_path / "home", tmp_path / "bg", tmp_path / "out"
    env = _env(tmp_path, 300, bundle=True)  # a bundle is being delivered, as on the lent machine
    assert _run(env, "wait", "1").returncode == 3  # nothing started yet: said by name, not a hang

    started = _run(env, "start", "--stages", "report")
    assert started.returncode == 0, started.stdout + started.stderr
    pid = int((bg / "pid").read_text())
    # the starting call has returned; the driver runs on in a session of its own
    assert os.getsid(pid) == pid

    # no vLLM install marker yet: the driver holds before the stages that need it, and wait says so
    still = _run(env, "wait", "4")
    assert still.returncode == 75, still.stdout + still.stderr
    assert "still running" in still.stdout
    assert not (bg / "rc").exists()

    (home / "vllm-site").mkdir()
    (home / "vllm-site" / ".installed").touch()
    done = _run(env, "wait", "100")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ended with status 0" in done.stdout
    assert "report:" in done.stdout  # the loop's own log came through
    for name in ("gpu_loop.json", "gpu_loop.md", "gpu_loop.png", "gpu_loop_bg.log"):
        assert (out / name).stat().st_size > 0, name
    j = json.loads((out / "gpu_loop.json").read_text())
    assert j["complete"] is False  # only the report ran: the report says so rather than claiming a loop
    # the run named its stages and the target was not among them: no target run before the install
    log = (out / "gpu_loop_bg.log").read_text()
    assert "stages report," in log and "stages target" not in log, log


def test_install_never_comes(tmp_path: Path) -> None:
    env = _env(tmp_path, 2, bundle=True)
    assert _run(env, "start", "--stages", "report").returncode == 0
    r = _run(env, "wait", "60")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "vLLM not installed after 2 s" in r.stdout


@pytest.mark.parametrize("args, first", [((), True), (("--stages", "target,eagle3,serve,report"), True),
                                         (("--stages=eagle3,serve",), False),
                                         (("--stages", "all", "--stages", "serve,report"), False)])
def test_target_runs_before_the_install_only_when_the_run_has_it(tmp_path: Path, args, first) -> None:
    """The driver that `start` writes: the target stage (no vLLM needed) runs ahead of the install only when
    the run's stages include it; the main run gets the arguments as given (the last --stages wins)."""
    bg = tmp_path / "bg"
    env = _env(tmp_path, 1, bundle=True)
    # the install marker never comes and the wait is 1 s: the driver stops by name, the fixture kills the rest
    assert _run(env, "start", *args).returncode == 0
    # the driver (scripts/gpu_bg.sh) holds the target run as PRE and the loop as JOB
    pre, job = subprocess.run(["bash", "-c", 'eval "$(grep -E "^(PRE|JOB)=" "$1")"; printf "%s\\0%s" "$PRE" "$JOB"',
                               "_", str(bg / "driver.sh")], capture_output=True, text=True, check=True).stdout.split("\0")
    if first:
        assert pre.startswith("WORK=") and pre.endswith("--stages target") and "bash scripts/gpu_loop.sh" in pre, pre
    else:
        assert pre == "", pre
    main = [ln for ln in job.splitlines() if "bash scripts/gpu_loop.sh" in ln]
    assert len(main) == 1, job
    given = main[0].split("gpu_loop.sh", 1)[1].split(";", 1)[0]
    assert shlex.split(given) == list(args), main[0]


def test_no_bundle_no_wait(tmp_path: Path) -> None:
    """On a machine that has vLLM installed (no bundle being delivered), the loop starts at once: it does not
    wait for the bundle's install marker, which would never come."""
    home, out = tmp_path / "home", tmp_path / "out"
    env = _env(tmp_path, 300, bundle=False)
    assert _run(env, "start", "--stages", "report").returncode == 0
    done = _run(env, "wait", "100")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ended with status 0" in done.stdout and "not installed" not in done.stdout
    assert not (home / "vllm-site").exists()
    assert (out / "gpu_loop.json").stat().st_size > 0
