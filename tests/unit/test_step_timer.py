"""benchmarks/step_timer/sitecustomize.py, as benchmarks/step_profile.py uses it: loaded at start-up through
PYTHONPATH, it wraps the listed functions when their module is imported, and each process writes its counters
on the signal. Run in a real child process: the counts and the dump must follow the calls made."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, signal, sys, time
from layertap.records import token_bytes, sha256_hex   # not a target: must stay unwrapped
from layertap.engine import cache_view                 # a target module: check_planes is wrapped on import
assert getattr(cache_view.check_planes, "__wrapped__", None) is not None, "not wrapped"
assert not hasattr(sha256_hex, "__wrapped__")
sig = signal.SIGRTMIN + 3
os.kill(os.getpid(), sig)          # dump 0: nothing called yet
geo = cache_view.view_geometry((8, 16, 2, 4), 2, 4, plane_axis=2)
import torch
for _ in range(5):
    cache_view.check_planes(geo, torch.zeros(3, dtype=torch.long), [torch.zeros(3, 4), torch.zeros(3, 4)])
os.kill(os.getpid(), sig)          # dump 1: five calls
time.sleep(0.2)
print("ok")
"""


def test_wrapped_functions_are_counted_and_dumped_on_the_signal(tmp_path):
    env = {**os.environ, "LAYERTAP_STEP_TIMER": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "step_timer"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    dumps = sorted(tmp_path.glob("*.json"), key=lambda f: int(f.name.split(".")[1]))
    assert [int(f.name.split(".")[1]) for f in dumps] == [0, 1]
    first, second = (json.loads(f.read_text())["stats"] for f in dumps)
    name = "cache_view:check_planes"
    assert first.get(name, [0, 0.0])[0] == 0
    calls, seconds = second[name]
    assert calls == 5 and seconds > 0


def test_without_the_variable_nothing_is_wrapped():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "step_timer"), str(ROOT)])}
    env.pop("LAYERTAP_STEP_TIMER", None)
    code = "from layertap.engine import cache_view; print(hasattr(cache_view.check_planes, '__wrapped__'))"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "False"


def test_a_wrapped_module_still_runs_with_python_m(tmp_path):
    """``python -m`` of a module the timer wraps (the record process, ``layertap.engine.record_proc``, is started
    so): runpy asks the module's loader for its code, which the timer's loader must hand on. Without it the
    record process failed to start under the step profile on the H100 (2026-12-06), and capture fell back to
    the in-process path without a sign in the profile's output."""
    env = {**os.environ, "LAYERTAP_STEP_TIMER": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "step_timer"), str(ROOT)])}
    p = subprocess.run([sys.executable, "-m", "layertap.engine.record_proc"], env=env, input=b"",
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-2000:]  # no configuration on stdin: it exits at once, cleanly


def test_the_report_prints_each_runs_pace_beside_its_throughput(capsys):
    """step_profile's report ends with one line a variant: per run, tokens/s and ms a call of the engine step and
    of the model's forward (summed over the run's processes), so a host whose pace drifts between runs shows it."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_profile

    def run(rate: float, step_s: float, fwd_s: float) -> dict:
        return {"rate": rate, "requests": 10, "procs": {
            "VLLM::EngineCore:1": {"core:EngineCore.step_with_batch_queue": [4, step_s],
                                   "qwen3:Qwen3ForCausalLM.forward": [2, fwd_s]},
            "python3:2": {"tap:Tap.step": [5, 0.01]}}}

    step_profile.report({"plain": [run(1000.0, 0.04, 0.03), run(900.0, 0.048, 0.036)],
                         "capture": [run(950.0, 0.044, 0.032)]}, 4)
    out = capsys.readouterr().out
    lines = {ln.split()[0]: ln for ln in out.splitlines()[-2:]}
    assert "1000 / 10.00 / 15.00" in lines["plain"] and "900 / 12.00 / 18.00" in lines["plain"], out
    assert "950 / 11.00 / 16.00" in lines["capture"], out
