"""Scale-out with Ray: several engine actors feed one trainer actor; records cross machines via Mooncake.

    driver ── TrainerActor (MooncakeSource -> Loop over the trainer)          one per run
          └─ EngineActor x N (Tap over a local shm pool -> proven records -> MooncakeSink)

Each engine proves its records locally (shm, zero network), then publishes them to the Mooncake store
under its own writer id; the trainer's source reads every writer in sequence order and deletes what it
took. Inputs are split round-robin over the engines. The driver creates the trainer first (its source
marks the run alive in the store), then the engines; it always kills every actor it started.

Needs ``pip install ray`` and a running ``mooncake_master`` (``capture.mooncake_master``). Call from
under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import time
from itertools import islice
from pathlib import Path
from typing import Any

from layertap.pipeline.config import PipelineConfig, from_dict


class EngineWorker:
    """Body of the engine actor: a Tap on a local shm pool, forwarding proven records to Mooncake."""

    def __init__(self, cfg: dict[str, Any], mooncake: dict[str, Any], name: str):
        from layertap.pipeline.build import make_plan, tap_factory
        from layertap.transport.base import get_transport

        self.cfg = from_dict(cfg)
        self.plan = make_plan(self.cfg)
        local = from_dict({**cfg, "capture": {**cfg["capture"], "transport": "shm", "mooncake_master": None}})
        self.factory = tap_factory(local, self.plan, Path(self.cfg.out))
        self.sink = get_transport("mooncake").make_sink(mooncake, name)

    def produce(self, shard: int, num_shards: int) -> dict[str, Any]:
        from layertap.pipeline.build import sampling_params
        from layertap.pipeline.manager import InferenceManager
        from layertap.records import record_tensors

        items = self.plan.items[shard::num_shards]
        mgr = InferenceManager(self.factory, items, mode=self.plan.mode, sampling_params=sampling_params(self.plan),
                               queue_records=self.cfg.capture.queue_records)
        try:
            mgr.start()
            for rec in mgr.records():
                self.sink.put(rec.key, record_tensors(rec), rec.meta)
            self.sink.flush()
        finally:
            mgr.close()
        return {"shard": shard, **mgr.rates.summary(), "rejected_indices": sorted(mgr.rates.rejected)}

    def close(self) -> None:
        self.sink.close()


class TrainerWorker:
    """Body of the trainer actor: a Mooncake source feeding the same ``Loop`` as ``layertap train``."""

    def __init__(self, cfg: dict[str, Any], mooncake: dict[str, Any]):
        import torch

        from layertap.pipeline.build import make_plan, new_trainer
        from layertap.transport.base import get_transport

        torch.set_num_threads(1)
        self.cfg = from_dict(cfg)
        self.out = Path(self.cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.plan = make_plan(self.cfg)
        self.tr = new_trainer(self.cfg, self.plan, self.out)
        self.source = get_transport("mooncake").make_source(mooncake)

    def ready(self) -> int:
        return len(self.plan.items)

    def train(self, expected: int, idle_timeout: float = 120.0) -> dict[str, Any]:
        from layertap.pipeline.run import Loop
        from layertap.train.data import records_from_source

        loop = Loop(self.cfg, self.tr, self.out, None)
        t0 = time.monotonic()
        recs = islice(records_from_source(self.source, poll_timeout=0.5, idle_timeout=idle_timeout), expected)
        writers: dict[str, int] = {}

        def counted():
            for r in recs:
                writers[r.meta.get("run", "?")] = writers.get(r.meta.get("run", "?"), 0) + 1
                yield r

        loop.run(counted())
        loop.save()
        return {"steps": self.tr.step, "consumed": len(loop.consumed), "wall_s": round(time.monotonic() - t0, 2),
                "records_per_engine_run": writers, "final_loss": self.tr.log.history[-1]["loss"]}

    def close(self) -> None:
        self.source.close()


def run_ray(cfg: PipelineConfig, *, num_engines: int = 2) -> dict[str, Any]:
    """Train with ``num_engines`` engine actors and one trainer actor on the connected Ray cluster."""
    import ray

    if cfg.capture.transport != "mooncake" or not cfg.capture.mooncake_master:
        raise ValueError("capture.transport must be mooncake (with capture.mooncake_master) for the Ray runner")
    from layertap.transport.base import get_transport

    mooncake = get_transport("mooncake").prepare({"master": cfg.capture.mooncake_master,
                                                  "segment_bytes": 256 << 20, "buffer_bytes": 64 << 20})
    d = cfg.to_dict()
    Trainer = ray.remote(num_cpus=1)(TrainerWorker)
    Engine = ray.remote(num_cpus=1)(EngineWorker)
    actors: list[Any] = []
    try:
        trainer = Trainer.remote(d, mooncake)
        actors.append(trainer)
        total = ray.get(trainer.ready.remote())
        engines = [Engine.remote(d, mooncake, f"engine-{i}") for i in range(num_engines)]
        actors += engines
        train_ref = trainer.train.remote(total)
        produced = ray.get([e.produce.remote(i, num_engines) for i, e in enumerate(engines)])
        rejected = sum(p["rejected"] for p in produced)
        if rejected:
            raise RuntimeError(f"{rejected} inputs were rejected by the engines; the trainer waits for {total}")
        result = ray.get(train_ref)
        ray.get([e.close.remote() for e in engines] + [trainer.close.remote()])
        return {"trainer": result, "engines": produced}
    finally:
        for a in actors:
            ray.kill(a)
