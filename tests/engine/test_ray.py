"""Scale-out on a local Ray cluster on this machine: 2 engine actors (tiny trained target) feed 1 trainer
actor through a real loopback Mooncake master; every input is trained on exactly once, both engines
contribute, and Ray's own processes, the master and the shared memory are gone at the end."""

from __future__ import annotations

import time

import psutil
import pytest

ray = pytest.importorskip("ray", reason="needs the ray extra")
pytest.importorskip("mooncake.store", reason="needs the mooncake extra (mooncake-transfer-engine-non-cuda)")

from layertap.pipeline.config import from_dict  # noqa: E402
from layertap.pipeline.ray_runner import run_ray  # noqa: E402

from tests.netutil import mooncake_master

pytestmark = pytest.mark.engine

N_INPUTS = 16
RAY_PROCS = ("raylet", "gcs_server", "ray::", "dashboard", "plasma_store", "default_worker")


def _ray_procs() -> list[str]:
    out = []
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        text = " ".join(p.info["cmdline"] or []) + " " + (p.info["name"] or "")
        if any(k in text for k in RAY_PROCS) and "pytest" not in text:
            out.append(f"{p.info['pid']} {text[:80]}")
    return out


@pytest.fixture
def master():
    with mooncake_master() as (addr, _, _):
        yield addr


def test_two_engines_feed_one_trainer(master, tmp_path):
    before = set(_ray_procs())
    cfg = from_dict({"out": str(tmp_path / "run"), "capture": {
        "transport": "mooncake", "mooncake_master": master, "limit": N_INPUTS, "epochs": 1, "max_tokens": 24,
        "max_inflight": 8}, "train": {"max_steps": N_INPUTS // 4, "batch_size": 4, "save_every": 0}})
    ray.init(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_LOGGING_LEVEL": "WARNING"}})
    try:
        res = run_ray(cfg, num_engines=2)
    finally:
        ray.shutdown()
    tr = res["trainer"]
    assert tr["consumed"] == N_INPUTS and tr["steps"] == N_INPUTS // 4, res
    assert len(tr["records_per_engine_run"]) == 2 and sum(tr["records_per_engine_run"].values()) == N_INPUTS, tr
    assert sorted(e["records"] for e in res["engines"]) == [N_INPUTS // 2, N_INPUTS // 2]
    deadline = time.monotonic() + 30
    while set(_ray_procs()) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(_ray_procs()) - before, f"Ray processes left: {set(_ray_procs()) - before}"
