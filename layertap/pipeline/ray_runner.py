"""Scale-out with Ray: several engine actors feed one trainer actor; records cross machines via Mooncake.

    driver ── TrainerActor (MooncakeSource -> Loop over the trainer)          one per run
          └─ EngineActor x N (Tap over a local shm pool -> proven records -> MooncakeSink)

Each engine proves its records locally (shm, zero network), then publishes them to the Mooncake store
under its own writer id; the trainer's source reads every writer in sequence order and deletes what it
took. Inputs are split round-robin over the engines. The driver creates the trainer first (its source
marks the run alive in the store), then the engines; it always kills every actor it started.

A run ends like ``layertap train``: final checkpoint, export, acceptance in vLLM (``eval``), and
OUT/report.json/.md/.png, written by the trainer actor; ``resume=True`` continues from OUT/checkpoint.pt
and the engines capture only the inputs no step consumed.

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

    def produce(self, shard: int, num_shards: int, skip: list[int] | None = None) -> dict[str, Any]:
        from layertap.pipeline.build import sampling_params
        from layertap.pipeline.manager import InferenceManager
        from layertap.records import record_tensors

        done = set(skip or ())
        items = [it for it in self.plan.items if it.index not in done][shard::num_shards]
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


class _RayRates:
    """The run report's counters, merged from the engine actors (in parallel) and the trainer actor."""

    def __init__(self, produced: list[dict[str, Any]], consumer: dict[str, float]):
        self.rejected = {i: "rejected by an engine" for p in produced for i in p.get("rejected_indices", [])}
        self.retried: list[int] = []
        self.produced, self.consumer = produced, consumer

    def summary(self) -> dict[str, Any]:
        pr, c = self.produced, self.consumer
        cons = max(c["wall_s"], 1e-9)
        return {
            "engines": len(pr), "submitted": sum(p["submitted"] for p in pr), "records": sum(p["records"] for p in pr),
            "rejected": len(self.rejected), "retried": sum(p.get("retried", 0) for p in pr),
            "producer_wall_s": max(p["producer_wall_s"] for p in pr),
            "producer_records_per_s": round(sum(p["producer_records_per_s"] for p in pr), 2),
            "producer_tokens_per_s": round(sum(p["producer_tokens_per_s"] for p in pr), 1),
            "producer_tokens": sum(p["producer_tokens"] for p in pr),
            "consumer_records": int(c["records"]), "consumer_wall_s": round(cons, 2),
            "consumer_tokens": int(c["tokens"]),
            "consumer_records_per_s": round(c["records"] / cons, 2),
            "consumer_tokens_per_s": round(c["tokens"] / cons, 1),
            "trainer_startup_wait_s": round(c["startup_wait_s"], 2), "trainer_idle_s": round(c["idle_s"], 2),
            "trainer_idle_fraction": round(c["idle_s"] / cons, 4),
        }


class TrainerWorker:
    """Body of the trainer actor: a Mooncake source feeding the same ``Loop`` as ``layertap train``; it
    also finishes the run (checkpoint, export, evaluation, report) where its files are."""

    def __init__(self, cfg: dict[str, Any], mooncake: dict[str, Any], resume: bool = False):
        import torch

        from layertap.pipeline.build import make_plan
        from layertap.pipeline.run import Parts, open_trainer, start_run_dir
        from layertap.transport.base import get_transport

        torch.set_num_threads(1)
        self.cfg = from_dict(cfg)
        self.out = start_run_dir(self.cfg, resume)
        self.plan = make_plan(self.cfg)
        self.tr = open_trainer(self.cfg, self.plan, self.out, resume)
        # This run's entry in OUT/parts.json, as ``layertap train`` keeps it: a resumed run's report sums
        # every part; an actor killed before ``finish`` leaves "running", which the next part marks "lost".
        self.parts = Parts(self.out, self.tr.step)
        self.source = get_transport("mooncake").make_source(mooncake)
        self.loop: Any = None
        self.stats = {"records": 0, "tokens": 0, "idle_s": 0.0, "startup_wait_s": 0.0, "wall_s": 0.0}

    def ready(self) -> tuple[int, list[int]]:
        """(inputs in the plan, indices a checkpointed step already consumed)."""
        return len(self.plan.items), sorted(self.tr.tcfg.extra.get("consumed", []))

    def train(self, expected: int, idle_timeout: float = 120.0) -> dict[str, Any]:
        from layertap.pipeline.run import Loop
        from layertap.train.data import records_from_source

        self.loop = loop = Loop(self.cfg, self.tr, self.out, None)
        t0 = time.monotonic()
        recs = islice(records_from_source(self.source, poll_timeout=0.5, idle_timeout=idle_timeout), expected)
        writers: dict[str, int] = {}
        st = self.stats

        def counted():
            it, first = iter(recs), None
            while True:
                w0 = time.monotonic()
                r = next(it, None)
                now = time.monotonic()
                if r is None:
                    return
                if first is None:
                    first = now
                    st["startup_wait_s"] = now - t0
                else:
                    st["idle_s"] += now - w0
                st["records"] += 1
                st["tokens"] += int(r.token_ids.shape[0])
                st["wall_s"] = now - first
                writers[r.meta.get("run", "?")] = writers.get(r.meta.get("run", "?"), 0) + 1
                yield r

        loop.run(counted())
        loop.save()
        return {"steps": self.tr.step, "consumed": len(loop.consumed), "wall_s": round(time.monotonic() - t0, 2),
                "records_per_engine_run": writers, "final_loss": self.tr.log.history[-1]["loss"]}

    def finish(self, produced: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
        """Final checkpoint, export, acceptance in vLLM (when ``eval.enabled``) and the run report."""
        from layertap.pipeline.evaluate import EvalRunner
        from layertap.pipeline.report import write_report
        from layertap.pipeline.run import export_step

        if self.tr.step == 0:
            raise RuntimeError(f"no optimizer step ran: {self.stats['records']} records arrived")
        e = self.cfg.eval
        evals = EvalRunner(self.out, self.plan.target, self.plan.eval_prompts, max_tokens=e.max_tokens,
                           ngram_k=e.ngram_k, kv_cache_mb=e.kv_cache_mb)
        try:
            ckpt = self.loop.save()
            self.tr.finish()
            drafters = export_step(self.cfg, self.tr, self.out, "final")
            final = evals.final(self.tr.step, drafters) if e.enabled else {}
            rates = _RayRates(produced, self.stats)
            return write_report(self.out, self.cfg, self.plan, self.tr, rates, evals, final, wall_s=wall_s,
                                checkpoint=ckpt, parts=self.parts.end("done", self.tr.step, rates.summary()))
        finally:
            evals.close()

    def close(self) -> None:
        self.source.close()


def run_ray(cfg: PipelineConfig, *, num_engines: int = 2, resume: bool = False) -> dict[str, Any]:
    """Train with ``num_engines`` engine actors and one trainer actor on the connected Ray cluster; returns
    ``{"trainer", "engines", "report"}`` (the report is also OUT/report.json/.md)."""
    import ray

    if cfg.capture.transport != "mooncake" or not cfg.capture.mooncake_master:
        raise ValueError("capture.transport must be mooncake (with capture.mooncake_master) for the Ray runner")
    from layertap.transport.base import get_transport

    wall0 = time.monotonic()
    mooncake = get_transport("mooncake").prepare({"master": cfg.capture.mooncake_master,
                                                  "segment_bytes": 256 << 20, "buffer_bytes": 64 << 20})
    d = cfg.to_dict()
    Trainer = ray.remote(num_cpus=1)(TrainerWorker)
    Engine = ray.remote(num_cpus=1)(EngineWorker)
    actors: list[Any] = []
    try:
        trainer = Trainer.remote(d, mooncake, resume)
        actors.append(trainer)
        total, consumed = ray.get(trainer.ready.remote())
        if resume:
            print(f"resuming: {len(consumed)} of {total} inputs already trained on", flush=True)
        engines = [Engine.remote(d, mooncake, f"engine-{i}") for i in range(num_engines)]
        actors += engines
        train_ref = trainer.train.remote(total - len(consumed))
        produced = ray.get([e.produce.remote(i, num_engines, consumed) for i, e in enumerate(engines)])
        rejected = sum(p["rejected"] for p in produced)
        if rejected:
            raise RuntimeError(f"{rejected} inputs were rejected by the engines; the trainer waits for "
                               f"{total - len(consumed)}")
        result = ray.get(train_ref)
        ray.get([e.close.remote() for e in engines])
        for e in engines:  # engines down before the evaluation engines start
            ray.kill(e)
        report = ray.get(trainer.finish.remote(produced, time.monotonic() - wall0))
        ray.get(trainer.close.remote())
        return {"trainer": result, "engines": produced, "report": report}
    finally:
        for a in actors:
            try:
                ray.kill(a)
            except ValueError:
                pass  # already gone
