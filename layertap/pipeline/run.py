"""``layertap train``: capture from a live vLLM engine, train a drafter online, evaluate, export, report.

    plan -> trainer (fresh, or the checkpoint on --resume) -> manager.start() (engine in a producer thread)
         -> train loop (checkpoint every N steps with the consumed input indices; background evals)
         -> close engine -> export -> final evaluation (plain, ngram, drafter) -> report

Everything started here is stopped in ``finally`` on success, error and Ctrl-C: the producer thread, the
engine core, the shm pool, evaluation children. A resumed run captures only the inputs whose records
no optimizer step has consumed yet (the checkpoint lists them), so no sample is trained on twice.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from layertap.pipeline.build import Plan, make_plan, new_trainer, sampling_params, tap_factory
from layertap.pipeline.config import PipelineConfig, from_dict
from layertap.pipeline.evaluate import EvalRunner
from layertap.pipeline.manager import InferenceManager
from layertap.records import Record

log = logging.getLogger("layertap")

RUN_CONFIG = "run_config.json"
PROGRESS = "progress.json"
PARTS = "parts.json"
"""One entry per invocation of the run (a resumed run has several): when it started, the step it started
from, how it ended and its producer / consumer rates. Written when the invocation starts (status
``running``) and again when it ends (``done``, ``interrupted``, ``failed``); an entry still ``running`` when
the next invocation starts ended without a handler (kill -9, a lost machine) and is marked ``lost``."""


class RunExists(FileExistsError):
    """``--out`` already holds a run; resume it or choose another directory."""


INTERRUPTED = threading.Event()
"""Set by ``layertap train``'s SIGINT/SIGTERM handler. A KeyboardInterrupt can be lost where a library
catches it (seen once in CI: a Ctrl-C sent after the records had all arrived was lost, and the run went
on to export and evaluate); the run also checks this flag between phases and at every step, so Ctrl-C
always stops it."""


_WAKEUP: list = []  # [read socket] once install_interrupt_handlers ran


def install_interrupt_handlers() -> None:
    """Ctrl-C and SIGTERM stop ``layertap train`` cleanly: a KeyboardInterrupt in the main thread (every
    ``finally`` runs: engine down, shared memory freed) and ``INTERRUPTED`` for the places that check.

    Python runs a signal's handler in the main thread only, possibly much later than the signal arrived
    (the main thread may be inside a long torch op). Ctrl-C reaches the whole process group at once, so the
    engine core dies of the same signal and the producer thread can see that death *before* the main
    thread's handler ran; it must not take it for a crash and retry on a fresh engine (that engine and
    its shared-memory pool were what a Ctrl-C could leave behind). The C-level handler, which runs as soon
    as the signal is delivered to this process, writes to a wakeup fd; ``interrupted()`` reads it, so any
    thread knows of the signal as soon as the process has it."""
    import signal
    import socket

    def interrupt(*_: object) -> None:
        INTERRUPTED.set()
        raise KeyboardInterrupt

    if not _WAKEUP:
        r, w = socket.socketpair()
        r.setblocking(False)
        w.setblocking(False)
        signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        _WAKEUP.extend([r, w])
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def interrupted() -> bool:
    """True once SIGINT/SIGTERM reached this process (from any thread, before the handler has run)."""
    if INTERRUPTED.is_set():
        return True
    if _WAKEUP:
        import select

        if select.select([_WAKEUP[0]], [], [], 0)[0]:
            INTERRUPTED.set()
    return INTERRUPTED.is_set()


def check_interrupted() -> None:
    if interrupted():
        raise KeyboardInterrupt


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def load_run_config(out: Path) -> PipelineConfig:
    p = out / RUN_CONFIG
    if not p.exists():
        raise FileNotFoundError(f"--resume: {out} holds no {RUN_CONFIG}; was it started by `layertap train`?")
    return from_dict(json.loads(p.read_text()))


def start_run_dir(cfg: PipelineConfig, resume: bool) -> Path:
    """Create ``cfg.out`` and save the run config there (``layertap train`` and the Ray runner alike);
    ``RunExists`` where it already holds a run and ``resume`` is off."""
    from layertap.train.trainer import CKPT

    out = Path(cfg.out)
    if not resume and (out / CKPT).exists():
        raise RunExists(f"{out} already holds a run ({CKPT}); pass --resume to continue it or choose a new --out")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / RUN_CONFIG, cfg.to_dict())
    if not resume:
        (out / PARTS).unlink(missing_ok=True)  # a fresh run: no earlier invocation belongs to it
    return out


class Parts:
    """This invocation's entry in ``PARTS`` (see there)."""

    def __init__(self, out: Path, step: int):
        self.path = out / PARTS
        try:
            self.all: list[dict[str, Any]] = json.loads(self.path.read_text()) if self.path.exists() else []
        except json.JSONDecodeError:  # written atomically, so only a hand-edited file gets here
            raise RuntimeError(f"{self.path} is not valid JSON; move it aside to resume without it") from None
        for p in self.all:
            if p.get("status") == "running":
                p["status"] = "lost"
        self.me = {"part": len(self.all) + 1, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "step_from": step,
                   "status": "running"}
        self.all.append(self.me)
        self.t0 = time.monotonic()
        _write_json(self.path, self.all)

    def end(self, status: str, step: int, rates: dict[str, Any] | None) -> list[dict[str, Any]]:
        self.me.update(status=status, step_to=step, wall_s=round(time.monotonic() - self.t0, 1), rates=rates)
        _write_json(self.path, self.all)
        return self.all


def open_trainer(cfg: PipelineConfig, plan: Plan, out: Path, resume: bool) -> Any:
    """The run's trainer: the checkpoint in ``out`` on ``resume`` (when there is one), else a fresh one."""
    from layertap.train.trainer import CKPT, Trainer

    ckpt = out / CKPT
    if resume and ckpt.exists():
        # The run config may extend the run (a larger train.max_steps); everything else comes from the checkpoint.
        tr = Trainer.load(ckpt, max_steps=cfg.train.max_steps)
        print(f"resumed at step {tr.step}: {len(tr.tcfg.extra['consumed'])} inputs already trained on", flush=True)
        return tr
    if resume:
        print(f"no checkpoint in {out} yet: starting from step 0", flush=True)
    return new_trainer(cfg, plan, out)


class Loop:
    """The train loop over a record stream: steps, checkpoints with consumed indices, eval triggers."""

    def __init__(self, cfg: PipelineConfig, tr: Any, out: Path, evals: EvalRunner | None):
        self.cfg, self.tr, self.out, self.evals = cfg, tr, out, evals
        self.consumed: set[int] = set(tr.tcfg.extra.get("consumed", []))
        self.pulled: list[int] = []
        self.selftest: Any = None
        """EAGLE-3 learns from the target's own distribution at the last layer id: the first records must
        show that id's rows reproduce the target's greedy tokens (train-offline checks its dataset the same
        way), or the run stops by name before it trains on wrong labels."""
        head, last = getattr(tr, "head", None), tr._layer_ids()[1]
        if head is not None and last is not None:
            from layertap.train.selftest import HeadSelfTest

            self.selftest = HeadSelfTest(head, last)

    def _tracked(self, records: Iterator[Record]) -> Iterator[Record]:
        st = self.selftest
        for rec in records:
            if st is not None and not st.done:
                st.add(rec)  # measured now: a record's memory may be reused once it is trained on
                if st.done:
                    print(st.result(), flush=True)
            self.pulled.append(rec.index)
            yield rec
        if st is not None and 0 < st.seen < st.n:  # fewer records than the test takes: report those
            print(st.result(), flush=True)

    def run(self, records: Iterator[Record]) -> None:
        from layertap.train.data import batches

        tr, t = self.tr, self.cfg.train
        aux, last = tr._layer_ids()
        t0 = time.monotonic()
        for b, _ in batches(self._tracked(records), t.batch_size, aux, last, t.max_len, tr.device):
            if tr.step >= tr.tcfg.max_steps:
                break
            check_interrupted()
            m = tr.train_step(b)
            # Every record pulled so far is in this batch (or was skipped as too short): consumed.
            self.consumed.update(self.pulled)
            self.pulled.clear()
            tr.records_seen = len(self.consumed)
            m["step"], m["tok_per_s"] = tr.step, m["tokens"] / max(time.monotonic() - t0, 1e-9)
            t0 = time.monotonic()
            tr.log.add(m, echo=tr.step % t.log_every == 0 or tr.step == 1)
            _write_json(self.out / PROGRESS, {"step": tr.step, "consumed": len(self.consumed)})
            if t.save_every and tr.step % t.save_every == 0:
                self.save()
            if self._eval_due():
                self.evals.submit(tr.step, export_step(self.cfg, tr, self.out, f"step-{tr.step}"))

    def _eval_due(self) -> bool:
        every, step = self.cfg.eval.every, self.tr.step
        # The last step is evaluated by the final (foreground) evaluation, with the baselines.
        return self.evals is not None and every > 0 and step % every == 0 and step < self.tr.tcfg.max_steps

    def save(self) -> Path:
        self.tr.tcfg.extra["consumed"] = sorted(self.consumed)
        return self.tr.save()


def export_step(cfg: PipelineConfig, tr: Any, out: Path, name: str) -> dict[str, dict[str, Any]]:
    """Export the trainer's current weights (via a checkpoint file) and return ``{kind: speculative_config}``."""
    from layertap.drafters.export import export, speculative_config

    ckpt = tr.save(out / "exports" / f"{name}.pt")
    d = export(ckpt, out / "exports" / name)
    ckpt.unlink()
    return {cfg.drafter: speculative_config(d, cfg.eval.num_spec if cfg.drafter == "eagle3" else None)}


def run(cfg: PipelineConfig, *, resume: bool = False) -> dict[str, Any]:
    """One ``layertap train`` run; returns the report dict (also written to OUT/report.json/.md)."""
    import torch

    from layertap.pipeline.report import write_report

    out = start_run_dir(cfg, resume)
    if cfg.train.threads or cfg.train.device == "cpu":
        torch.set_num_threads(cfg.train.threads or max(1, (os.cpu_count() or 2) // 2))
    wall0 = time.monotonic()
    plan = make_plan(cfg)
    tr = open_trainer(cfg, plan, out, resume)
    loop = Loop(cfg, tr, out, None)
    evals = EvalRunner(out, plan.target, plan.eval_prompts, max_tokens=cfg.eval.max_tokens,
                       ngram_k=cfg.eval.ngram_k, kv_cache_mb=cfg.eval.kv_cache_mb)
    loop.evals = evals if cfg.eval.enabled else None
    evals.load_earlier(tr.step, tr.tcfg.max_steps)  # a resumed run's earlier evaluations stay in its curve
    parts = Parts(out, tr.step)
    mgr = InferenceManager(tap_factory(cfg, plan, out), plan.items, mode=plan.mode,
                           sampling_params=sampling_params(plan), skip=loop.consumed,
                           queue_records=cfg.capture.queue_records, should_stop=interrupted)
    print(f"layertap train: {cfg.drafter} on {plan.target}; {len(mgr.items)} inputs to capture "
          f"({len(loop.consumed)} already trained on), layers {plan.layers}, {cfg.capture.transport}", flush=True)
    status = "failed"
    try:
        try:
            mgr.start()
            loop.run(mgr.records())
        finally:
            mgr.close()  # engine down and transport freed before evaluation engines start
        check_interrupted()
        if tr.step == 0:
            raise RuntimeError(f"no optimizer step ran: {mgr.rates.consumed} records arrived "
                               f"({len(mgr.rates.rejected)} inputs rejected)")
        ckpt = loop.save()
        tr.finish()
        drafters = export_step(cfg, tr, out, "final")
        check_interrupted()
        final = evals.final(tr.step, drafters) if cfg.eval.enabled else {}
        check_interrupted()
        return write_report(out, cfg, plan, tr, mgr.rates, evals, final, wall_s=time.monotonic() - wall0,
                            checkpoint=ckpt, parts=parts.end("done", tr.step, mgr.rates.summary()))
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        evals.close()
        if parts.me["status"] == "running":  # not ended above: an interrupt or an error
            parts.end(status, tr.step, mgr.rates.summary())
