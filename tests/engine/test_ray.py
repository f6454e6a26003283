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


def test_two_engines_feed_one_trainer_then_resume_to_a_report(master, tmp_path):
    """Run 1 stops at step 2 (8 of 16 inputs); run 2 resumes it to step 4 with only the 8 unconsumed inputs
    captured, evaluates the drafter in vLLM and writes the report, as ``layertap train`` does."""
    before = set(_ray_procs())
    base = {"out": str(tmp_path / "run"), "capture": {
        "transport": "mooncake", "mooncake_master": master, "limit": N_INPUTS, "epochs": 1, "max_tokens": 24,
        "max_inflight": 8}, "train": {"max_steps": 2, "batch_size": 4, "save_every": 0},
        "eval": {"enabled": False}}
    ray.init(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_LOGGING_LEVEL": "WARNING"}})
    try:
        res = run_ray(from_dict(base), num_engines=2)
        tr = res["trainer"]
        assert tr["consumed"] == 8 and tr["steps"] == 2, res
        assert len(tr["records_per_engine_run"]) == 2, tr  # both engines' records reached the trainer
        assert sorted(e["records"] for e in res["engines"]) == [N_INPUTS // 2, N_INPUTS // 2]
        assert res["report"]["acceptance"] == {} and res["report"]["rates"]["engines"] == 2
        first = _ckpt_consumed(tmp_path / "run")
        assert len(first) == 8

        more = {**base, "train": {**base["train"], "max_steps": N_INPUTS // 4},
                "eval": {"enabled": True, "num_prompts": 4, "max_tokens": 16}}
        res2 = run_ray(from_dict(more), num_engines=2, resume=True)
    finally:
        ray.shutdown()
    assert res2["trainer"]["steps"] == N_INPUTS // 4
    assert sum(e["submitted"] for e in res2["engines"]) == N_INPUTS - 8  # consumed inputs not captured again
    assert sorted(_ckpt_consumed(tmp_path / "run")) == list(range(N_INPUTS))
    rep = res2["report"]
    assert [r["name"] for r in rep["acceptance"]["results"]] == ["ngram", "eagle3"]
    assert all(r["outputs_match_plain"] for r in rep["acceptance"]["results"])
    # The report covers both invocations: parts.json's two entries, their capture and training summed.
    assert [p["status"] for p in rep["parts"]] == ["done", "done"], rep["parts"]
    p1, p2 = (p["rates"] for p in rep["parts"])
    assert p1["submitted"] == N_INPUTS and p2["submitted"] == N_INPUTS - 8
    tot = rep["rates_total"]
    assert tot["parts"] == 2 and tot["submitted"] == 2 * N_INPUTS - 8
    assert tot["consumer_records"] == p1["consumer_records"] + p2["consumer_records"] >= N_INPUTS
    assert tot["consumer_tokens"] == p1["consumer_tokens"] + p2["consumer_tokens"] > 0
    assert (tmp_path / "run" / "report.md").exists() and (tmp_path / "run" / "report.png").exists()
    assert (tmp_path / "run" / "exports" / "final" / "config.json").exists()
    deadline = time.monotonic() + 30
    while set(_ray_procs()) - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not set(_ray_procs()) - before, f"Ray processes left: {set(_ray_procs()) - before}"


def _ckpt_consumed(out) -> list[int]:
    import torch

    sd = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    return list(sd["train_config"]["extra"]["consumed"])
