"""Engine start-up settings layertap applies around vLLM (no engine started here; the engine tests run
every capture engine with them)."""

import os

from layertap.engine import launch
from layertap.engine.launch import engine_kwargs


SPAWN = {launch.MP_METHOD_ENV: "spawn"}


def test_cpu_capture_engine_reserves_one_core_per_worker():
    assert launch.engine_env(False, {}, environ={}) == {launch.CPU_RESERVED_ENV: "1", **SPAWN}
    assert launch.engine_env(False, {"tensor_parallel_size": 2}, environ={}) == {launch.CPU_RESERVED_ENV: "2", **SPAWN}
    assert launch.engine_env(False, {"tensor_parallel_size": "2", "pipeline_parallel_size": 2},
                             environ={}) == {launch.CPU_RESERVED_ENV: "4", **SPAWN}


def test_engines_are_spawned_unless_the_user_chose():
    """A forked engine deadlocks in OpenMP once this process ran multi-threaded CPU ops (seen on the H200)."""
    assert launch.engine_env(True, {}, environ={}) == SPAWN
    assert launch.engine_env(True, {}, environ={launch.MP_METHOD_ENV: "fork"}) == {}


def test_user_setting_is_left_alone():
    assert launch.engine_env(False, {}, environ={launch.CPU_RESERVED_ENV: "3", **SPAWN}) == {}


def test_engine_env_set_restores_the_environment(monkeypatch):
    monkeypatch.delenv("LAYERTAP_TEST_A", raising=False)
    monkeypatch.setenv("LAYERTAP_TEST_B", "old")
    with launch.engine_env_set({"LAYERTAP_TEST_A": "1", "LAYERTAP_TEST_B": "new"}):
        assert os.environ["LAYERTAP_TEST_A"] == "1" and os.environ["LAYERTAP_TEST_B"] == "new"
    assert "LAYERTAP_TEST_A" not in os.environ and os.environ["LAYERTAP_TEST_B"] == "old"


def test_serve_counts_workers_from_the_engine_flags():
    """`layertap serve` passes engine flags through; the workers are counted by vLLM's own parser."""
    assert launch.engine_env(False, engine_kwargs(["-tp", "2", "--pipeline-parallel-size=2"]), environ={}) == {
        launch.CPU_RESERVED_ENV: "4", **SPAWN}
    assert launch.engine_env(False, engine_kwargs(["--max-model-len", "64"]), environ={}) == {
        launch.CPU_RESERVED_ENV: "1", **SPAWN}
