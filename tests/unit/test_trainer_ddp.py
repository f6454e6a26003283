"""Data-parallel trainer on real processes (CPU, gloo over 127.0.0.1): 2 ranks x batch B train like one
process with batch 2B on the same records, both ranks hold identical parameters, only rank 0 writes, a
resume from the 2-rank checkpoint continues the same run, and a rank whose stream ends first stops every
rank at the same step instead of hanging.

What "train like one process" means here, and why it is checked per step: the 2-rank gradient (each rank
the gradient of its rows, re-weighted by the global position count, then summed by all-reduce) equals the
single-process full-batch gradient up to fp32 rounding only (the sums run in another order). Comparing
*parameters after several AdamW steps* has no principled tolerance: Adam divides by sqrt(v) + eps, so for
an element whose gradient is near zero a rounding-level difference becomes an O(lr) step, and the runs
drift apart. So each rank records, at every optimizer step, the parameters it steps from and the gradients
the optimizer sees (after the all-reduce and clipping); one process then loads those same parameters, runs
its own ``Trainer.fit`` over the same global batches (its own anchor generator, advanced in lockstep with
the ranks'; their states are compared exactly at every step), and must produce the same gradients and
loss to within ``RTOL`` (its value is argued there). Controls (``test_checker_catches_faults``) inject
faults into the real rank code path and show that the same check fails on them."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.multiprocessing as mp

from layertap.drafters.eagle3 import draft_vocab_from_counts
from layertap.records import token_digest
from layertap.train.config import DFlashConfig, Eagle3Config, TrainConfig
from layertap.train.data import epoch_stream, token_counts, write_dataset
from layertap.train.fixtures import shape, tiny_records, tiny_target
from layertap.train.trainer import Trainer
from layertap.transport.file import load_records
from tests.netutil import free_port

torch.set_num_threads(1)

WORLD = 2
GLOBAL_BATCH = 4  # 2 records per rank per step
EPOCHS = 3        # 7 trainable records (+1 too short) per epoch: 21 -> 5 full steps and a final 1-record step
STOP = 3          # interrupt (checkpoint) after this step, then resume to the end of the stream
CONTROL_STEPS = 2
TIMEOUT = 120.0
RTOL = {"cpu": 1e-4, "cuda": 1e-3}
"""Allowed error of a rank's step against the single-process step at the same parameters: per gradient
tensor ``max|g_rank - g_ref| <= RTOL * max|g_ref|``; relative, for the pre-clipping gradient norm and the
step loss. Both sides run the same fp32 forward/backward on the same rows; only the summation order
differs (rows split over 2 ranks and then summed, other kernel blockings for another batch size). fp32
sums of a few thousand terms (eps 6e-8) round at ~1e-6 relative; measured on CPU: <= 8e-7 for gradients,
<= 2e-7 for losses. 1e-4 leaves two orders of magnitude above that, while a real data-parallel bug (a
missing all-reduce, a wrong loss normaliser, a rank training other rows) is off by O(1) of the value:
the controls (test_checker_catches_faults) are off by 0.3-1. CUDA kernels pick reduction splits by
shape: 1e-3, still far from O(1)."""
TINY = 1e-30
"""Scale floor for tensors whose reference gradient is all zero: then the rank's must be (nearly) zero too."""


def _dataset(root: Path) -> Path:
    """7 tiny records plus one too short to train (skipped but counted): shards must follow the skip."""
    recs = list(tiny_records())[:7]
    r0 = recs[0]
    short = dataclasses.replace(r0, index=100, token_ids=r0.token_ids[:2], hidden_states=r0.hidden_states[:2],
                                num_prompt_tokens=1, loss_mask=None if r0.loss_mask is None else r0.loss_mask[:2],
                                meta={**r0.meta, "index": 100, "num_tokens": 2, "num_prompt_tokens": 1,
                                      "token_digest": token_digest(r0.token_ids[:2])})
    return write_dataset(recs + [short], root, {"model": str(tiny_target())})


def _make(kind: str, out: Path, ds, *, steps: int = 20, batch: int = GLOBAL_BATCH, device: str = "cpu") -> Trainer:
    tcfg = TrainConfig(out_dir=str(out), max_steps=steps, batch_size=batch, lr=3e-3, warmup_steps=2,
                       log_every=1000, tensorboard=True, max_len=96, device=device)
    if kind == "eagle3":
        cfg = Eagle3Config(shape=shape(), aux_layer_ids=[1, 2, 3], last_layer_id=4, draft_vocab_size=512)
        return Trainer("eagle3", cfg, tcfg, tiny_target(), draft_vocab_from_counts(token_counts(ds, 2048), 512))
    cfg = DFlashConfig(shape=shape(), target_layer_ids=[0, 1, 2], block_size=4, mask_token_id=4, anchors_per_seq=16)
    return Trainer("dflash", cfg, tcfg, tiny_target())


def _params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in tr.model.state_dict().items()}


def _trainable(tr: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in tr.model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def _recording(tr: Trainer, trace: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """While active, append to ``trace`` at each optimizer step of ``tr``: the step index, the trainable
    parameters it steps from, the gradients it sees (on ranks: all-reduced, then clipped; None where
    unused), the total gradient norm before clipping (clipping rescales to ``grad_clip`` and so would hide
    a uniformly mis-scaled gradient) and the anchor generator's state (after this step's draw)."""
    clip, step, norms = torch.nn.utils.clip_grad_norm_, tr.opt.step, []

    def clip_recording(*a, **kw):
        norm = clip(*a, **kw)
        norms.append(float(norm))
        return norm

    def step_recording(*a, **kw):
        trace.append({"step": tr.step, "params": _trainable(tr), "norm": norms.pop(),
                      "gen": tr.gen.get_state().clone(),
                      "grads": {n: None if p.grad is None else p.grad.detach().cpu().clone()
                                for n, p in tr.model.named_parameters() if p.requires_grad}})
        return step(*a, **kw)

    torch.nn.utils.clip_grad_norm_, tr.opt.step = clip_recording, step_recording
    try:
        yield trace
    finally:
        torch.nn.utils.clip_grad_norm_ = clip
        del tr.opt.step


def _losses(tr: Trainer) -> list[float]:
    return [h["loss"] for h in tr.log.history]


def _state_equal(a: Any, b: Any) -> bool:
    """Exact equality of nested optimizer state (dicts, lists, tensors, numbers)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_state_equal, a, b))
    return a == b


def _join(rank: int, port: int) -> None:
    """Start like torchrun starts a rank (env only); the trainer joins the group itself."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)


def _worker(rank: int, port: int, kind: str, tmp: str, device: str) -> None:
    _join(rank, port)
    tmp_p = Path(tmp)
    ds = load_records(tmp_p / "ds")
    res: dict = {"trace": []}
    # Each rank gets its own out_dir, so anything a non-zero rank wrote would show up in run1/.
    tr = _make(kind, tmp_p / f"run{rank}", ds, device=device)
    assert str(tr.device) == ("cpu" if device == "cpu" else f"cuda:{rank}")
    with _recording(tr, res["trace"]):
        tr.fit(epoch_stream(ds, EPOCHS, 0), stop_after=STOP)  # interrupted
    tr.save()
    res["interrupted"] = {"step": tr.step, "seen": tr.records_seen, "params": _params(tr)}
    # Resume from rank 0's checkpoint on both ranks (it names run0 as out_dir) and train to the end.
    rt = Trainer.load(tmp_p / "run0" / "checkpoint.pt")
    res["resumed_opt_equal"] = _state_equal(rt.opt.state_dict(), tr.opt.state_dict())
    with _recording(rt, res["trace"]):
        rt.fit(epoch_stream(ds, EPOCHS, 0))
    rt.finish()
    res["final"] = {"step": rt.step, "seen": rt.records_seen, "params": _params(rt), "loss": _losses(rt)}
    if kind == "eagle3" and device == "cpu":
        # Uneven shards: rank 1's stream ends after 7 records (mid global batch 2), rank 0's goes on.
        stream = list(epoch_stream(ds, EPOCHS, 0))
        ut = _make(kind, tmp_p / f"uneven{rank}", ds, batch=GLOBAL_BATCH)
        ut.fit(stream if rank == 0 else stream[:7])
        res["uneven"] = {"step": ut.step, "params": _params(ut)}
    torch.save(res, tmp_p / f"result{rank}.pt")


def _run_ranks(fn, args: tuple) -> None:
    """Run ``fn(rank, *args)`` on WORLD spawned processes; fail (and kill them) if they outlive TIMEOUT."""
    ctx = mp.start_processes(fn, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"ranks still running after {TIMEOUT:.0f}s: a collective hangs")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def _launch(kind: str, tmp: Path, device: str) -> list[dict]:
    _run_ranks(_worker, (free_port(), kind, str(tmp), device))
    return [torch.load(tmp / f"result{r}.pt", weights_only=False) for r in range(WORLD)]


@contextlib.contextmanager
def _following(one: Trainer, trace: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """While active, ``one`` (a single-process trainer; fit it on the ranks' stream) follows a rank's
    trajectory: before each of its steps it loads the parameters that rank stepped from, so the trace it
    yields (filled as it fits) and its logged losses are the single-process full-batch values at the
    rank's parameters. Its anchor generator is its own, advanced by its own steps. One intra-op thread,
    as on the ranks (earlier tests in this process may have changed the count)."""
    train_step, params, n_threads = one.train_step, dict(one.model.named_parameters()), torch.get_num_threads()

    def on_rank_params(b):
        with torch.no_grad():
            for n, t in trace[one.step]["params"].items():
                params[n].copy_(t)
        return train_step(b)

    one.train_step = on_rank_params
    torch.set_num_threads(1)
    try:
        with _recording(one, []) as ref:
            yield ref
    finally:
        torch.set_num_threads(n_threads)
        del one.train_step


def _mismatches(trace: list[dict[str, Any]], losses: list[float], ref: list[dict[str, Any]],
                ref_losses: list[float], rtol: float) -> list[tuple]:
    """Every disagreement between a rank's steps and the single-process steps at the same parameters, as
    (step, what, relative error): a gradient tensor off by more than ``rtol`` of the reference tensor's
    largest entry, the pre-clipping gradient norm or the step loss off by more than ``rtol`` relative,
    an anchor generator in another state. Empty when the rank trained like one process."""
    assert len(trace) == len(ref) == len(losses) == len(ref_losses), (len(trace), len(ref), len(losses))
    bad: list[tuple] = []
    for s, (a, b) in enumerate(zip(trace, ref)):
        assert a["step"] == b["step"] == s
        if not torch.equal(a["gen"], b["gen"]):
            bad.append((s + 1, "anchor generator state", math.inf))
        assert a["grads"].keys() == b["grads"].keys()
        for n, gr in b["grads"].items():
            g = a["grads"][n]
            if (g is None) != (gr is None):
                bad.append((s + 1, f"{n} (gradient on one side only)", math.inf))
            elif g is not None:
                err = float((g - gr).abs().max()) / max(float(gr.abs().max()), TINY)
                if err > rtol:
                    bad.append((s + 1, n, err))
        for what, x, y in (("grad norm before clipping", a["norm"], b["norm"]), ("loss", losses[s], ref_losses[s])):
            err = abs(x - y) / max(abs(y), TINY)
            if err > rtol:
                bad.append((s + 1, what, err))
    return bad


_CUDA2 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                            reason="nccl variant needs 2 CUDA devices")


@pytest.mark.parametrize("kind,device", [("eagle3", "cpu"), ("dflash", "cpu"),
                                         pytest.param("eagle3", "cuda", marks=_CUDA2),
                                         pytest.param("dflash", "cuda", marks=_CUDA2)])
def test_two_ranks_equal_one_process(kind, device, tmp_path):
    ds_dir = _dataset(tmp_path / "ds")
    res = _launch(kind, tmp_path, device)
    ds = load_records(ds_dir)
    trace = res[0]["trace"]
    assert [t["step"] for t in trace] == list(range(6))

    # Both ranks step from bit-identical parameters with bit-identical (summed) gradients at every step,
    # and end identical.
    for s, (a, b) in enumerate(zip(trace, res[1]["trace"], strict=True)):
        for n in a["params"]:
            assert torch.equal(a["params"][n], b["params"][n]), ("params before step", s + 1, n)
            assert (a["grads"][n] is None) == (b["grads"][n] is None), ("grad", s + 1, n)
            assert a["grads"][n] is None or torch.equal(a["grads"][n], b["grads"][n]), ("grad", s + 1, n)
    for leg in ("interrupted", "final"):
        for n, t in res[0][leg]["params"].items():
            assert torch.equal(t, res[1][leg]["params"][n]), (leg, n)

    # The resume continues the run: step 4 starts from the interrupted parameters and optimizer state.
    for n, t in trace[STOP]["params"].items():
        assert torch.equal(t, res[0]["interrupted"]["params"][n]), ("resume", n)
    assert res[0]["resumed_opt_equal"] and res[1]["resumed_opt_equal"]

    # One process on the same global batches (interrupted at STOP, then on to the end of the stream), at
    # each step on the parameters the ranks stepped from; its anchor generator advances on its own.
    one = _make(kind, tmp_path / "single", ds, device=device)
    for n, t in _trainable(one).items():
        assert torch.equal(t, trace[0]["params"][n]), ("initial params", n)  # the same start
    with _following(one, trace) as ref:
        one.fit(epoch_stream(ds, EPOCHS, 0), stop_after=STOP)
        at_stop = (one.step, one.records_seen)
        one.fit(epoch_stream(ds, EPOCHS, 0))
    assert one.step == 6  # 5 full global batches and a final one of a single record (rank 1 idle)
    for r in range(WORLD):
        assert (res[r]["interrupted"]["step"], res[r]["interrupted"]["seen"]) == at_stop
        assert (res[r]["final"]["step"], res[r]["final"]["seen"]) == (one.step, one.records_seen)
    assert _mismatches(trace, res[0]["final"]["loss"], ref, _losses(one), RTOL[device]) == []

    # Rank 0's final checkpoint holds its final state; the history spans both legs.
    sd = torch.load(tmp_path / "run0" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert sd["step"] == one.step and sd["records_seen"] == one.records_seen
    for n, t in res[0]["final"]["params"].items():
        assert torch.equal(sd["model"][n].cpu(), t), ("final checkpoint", n)
    assert [h["loss"] for h in sd["history"]] == res[0]["final"]["loss"]
    assert [h["tokens"] for h in sd["history"]] == [h["tokens"] for h in one.log.history]

    # Only rank 0 wrote: its run dir has the artefacts, rank 1's was never created.
    assert {"checkpoint.pt", "training.png", "history.json", "tb"} <= {p.name for p in (tmp_path / "run0").iterdir()}
    assert not (tmp_path / "run1").exists()

    if kind == "eagle3" and device == "cpu":
        # Rank 1 ran out inside step 2: both ranks trained step 2 (rank 1 on its last record), then stopped.
        assert res[0]["uneven"]["step"] == res[1]["uneven"]["step"] == 2
        for n, t in res[0]["uneven"]["params"].items():
            assert torch.equal(t, res[1]["uneven"]["params"][n]), n
        assert not (tmp_path / "uneven1").exists()


FAULTS = ("missing_grad_all_reduce", "local_loss_normaliser")


def _fault_worker(rank: int, port: int, tmp: str) -> None:
    """Controls: the real rank code path (``Trainer.fit`` -> ``dist_step``) with ``tdist.all_reduce``
    broken one way per fault: the gradient all-reduces skipped, or the step's first sum (the position
    counts each step loss is normalised by) left local. CONTROL_STEPS eagle3 steps each."""
    _join(rank, port)
    import layertap.train.trainer as trainer_mod

    tmp_p = Path(tmp)
    ds = load_records(tmp_p / "ds")
    real = trainer_mod.tdist.all_reduce
    state: dict[str, Any] = {"fault": None, "counts_next": False, "grads": ()}

    def broken(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op == "min":  # _fit_dist's per-step agreement: the next sum is dist_step's position counts
            state["counts_next"] = True
            return real(t, op)
        counts, state["counts_next"] = state["counts_next"], False
        if state["fault"] == "local_loss_normaliser" and counts:
            return t
        if state["fault"] == "missing_grad_all_reduce" and any(t is g for g in state["grads"]()):
            return t
        return real(t, op)

    trainer_mod.tdist.all_reduce = broken
    res = {}
    for fault in FAULTS:
        tr = _make("eagle3", tmp_p / f"{fault}{rank}", ds, steps=CONTROL_STEPS)
        state.update(fault=fault, grads=lambda: [p.grad for p in tr.model.parameters() if p.grad is not None])
        with _recording(tr, []) as trace:
            tr.fit(epoch_stream(ds, 1, 0))
        res[fault] = {"trace": trace, "loss": _losses(tr)}
    torch.save(res, tmp_p / f"faults{rank}.pt")


def test_checker_catches_faults(tmp_path):
    """The per-step comparison of test_two_ranks_equal_one_process reports each injected fault."""
    ds_dir = _dataset(tmp_path / "ds")
    _run_ranks(_fault_worker, (free_port(), str(tmp_path)))
    res = torch.load(tmp_path / "faults0.pt", weights_only=False)
    ds = load_records(ds_dir)
    for fault in FAULTS:
        trace = res[fault]["trace"]
        assert len(trace) == CONTROL_STEPS
        one = _make("eagle3", tmp_path / f"single-{fault}", ds, steps=CONTROL_STEPS)
        with _following(one, trace) as ref:
            one.fit(epoch_stream(ds, 1, 0))
        bad = _mismatches(trace, res[fault]["loss"], ref, _losses(one), RTOL["cpu"])
        # Caught on the gradient side at the first step already, and not as rounding (O(1) errors). With
        # the local normaliser (both ranks hold equal position counts at step 1) the gradient is twice the
        # true one, which clipping (active here) scales back to the same tensors: the pre-clipping norm
        # shows it, and so does the logged loss (a sum of per-rank means, also twice the true one).
        first = [e for e in bad if e[0] == 1 and e[1] not in ("loss", "anchor generator state")]
        assert first and max(e[2] for e in first) > 0.3, (fault, bad)
        if fault == "local_loss_normaliser":
            assert (1, "grad norm before clipping") in [e[:2] for e in bad], bad
            assert (1, "loss") in [e[:2] for e in bad], bad


def _bad_worker(rank: int, port: int, tmp: str) -> None:
    _join(rank, port)
    from layertap.train.dist import DistSetupError

    ds = load_records(Path(tmp) / "ds")
    errors = []
    try:
        _make("eagle3", Path(tmp) / "bad", ds, batch=3)
    except DistSetupError as e:
        errors.append(str(e))
    tr = _make("eagle3", Path(tmp) / "bad", ds, batch=2)
    try:
        tr.fit([ds[0]])  # one trainable record for two ranks
    except DistSetupError as e:
        errors.append(str(e))
    torch.save(errors, Path(tmp) / f"errors{rank}.pt")


def test_bad_setups_name_the_problem(tmp_path):
    _dataset(tmp_path / "ds")
    _run_ranks(_bad_worker, (free_port(), str(tmp_path)))
    for r in range(WORLD):
        errors = torch.load(tmp_path / f"errors{r}.pt")
        assert len(errors) == 2, errors
        assert "batch_size=3" in errors[0] and "not divisible by the world size 2" in errors[0]
        assert "world size 2 exceeds the 1 trainable record(s)" in errors[1]
