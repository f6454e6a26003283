"""The engine watchdog on real processes (no engine): a report names each process's state and carries
the Python stacks and log lines of processes that registered for them; a phase that outlives its limit
raises the named error, kills the processes it started, and a phase that ends in time raises nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from layertap.engine import watchdog

SLEEPER = ("import logging, os, time\n"
           "from layertap.engine import watchdog\n"
           "watchdog.register_stack_dumps()\n"
           "logging.getLogger('vllm').warning('sleeper is up')\n"
           "def stuck_here():\n"
           "    print('ready', flush=True)  # from inside: a stack dump taken after this shows the frame\n"
           "    time.sleep(120)\n"
           "stuck_here()\n")


def _sleeper(diag) -> subprocess.Popen:
    env = {**os.environ, watchdog.DIAG_ENV: str(diag)}
    p = subprocess.Popen([sys.executable, "-c", SLEEPER], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_report_names_state_stacks_and_log_lines(tmp_path):
    p = _sleeper(tmp_path)
    try:
        procs = [q for q in watchdog.descendants() if q["pid"] == p.pid]
        assert procs, "the child is not among this process's descendants"
        text = watchdog.report(procs, tmp_path, wait_dumps=1.0)
        assert f"pid {p.pid}" in text and "state S" in text  # asleep in time.sleep
        assert "stuck_here" in text, text  # its Python stack, from faulthandler on SIGUSR2
        assert "sleeper is up" in text, text  # its last log lines
        assert p.poll() is None, "SIGUSR2 must not kill the process"
    finally:
        p.kill()
        p.wait()


def test_start_phase_past_its_limit_raises_and_kills_what_it_started(tmp_path):
    wd = watchdog.Watchdog(start_timeout=2, step_timeout=60, diag=tmp_path, grace=1.0, poll=0.1)
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        with pytest.raises(watchdog.EngineStartTimeout) as exc:
            with wd.starting():
                procs.append(_sleeper(tmp_path))
                while True:  # a start-up that never ends, in this process
                    time.sleep(0.05)
        took = time.monotonic() - t0
        msg = str(exc.value)
        assert "did not finish starting within 2 s" in msg and f"pid {procs[0].pid}" in msg, msg
        assert "stuck_here" in msg, msg
        assert took < 15, took
        assert procs[0].wait(timeout=10) == -9  # killed by the watchdog
        with pytest.raises(watchdog.EngineStartTimeout):  # the watchdog stays failed
            with wd.stepping():
                pass
    finally:
        wd.close()
        for p in procs:
            p.kill()


def test_phases_within_their_limits_pass_and_bad_limits_are_refused(tmp_path):
    wd = watchdog.Watchdog(start_timeout=5, step_timeout=5, diag=tmp_path, poll=0.05)
    try:
        with wd.starting():
            p = _sleeper(tmp_path)
        for _ in range(3):
            with wd.stepping():
                time.sleep(0.1)
        assert [q["pid"] for q in wd.engine_procs()] == [p.pid]  # the child gained during start-up
        time.sleep(0.3)
        assert wd.error is None and p.poll() is None
    finally:
        wd.close()
        p.kill()
        p.wait()
    for bad in (0, -1, None):
        with pytest.raises(ValueError, match="start_timeout"):
            watchdog.Watchdog(start_timeout=bad, step_timeout=5)
