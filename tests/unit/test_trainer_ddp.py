"""Data-parallel trainer on real processes (CPU, gloo over 127.0.0.1): 2 ranks x batch B train like one
process with batch 2B on the same records (checkpoints, losses, records_seen), both ranks end with
identical parameters, only rank 0 writes, a resume from the 2-rank checkpoint continues the same run,
and a rank whose stream ends first stops every rank at the same step instead of hanging."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

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
TIMEOUT = 120.0


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


def _worker(rank: int, port: int, kind: str, tmp: str, device: str) -> None:
    """One rank, started like torchrun starts it (env only); the trainer joins the group itself."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    tmp_p = Path(tmp)
    ds = load_records(tmp_p / "ds")
    res: dict = {}
    # Each rank gets its own out_dir, so anything a non-zero rank wrote would show up in run1/.
    tr = _make(kind, tmp_p / f"run{rank}", ds, device=device)
    assert str(tr.device) == ("cpu" if device == "cpu" else f"cuda:{rank}")
    tr.fit(epoch_stream(ds, EPOCHS, 0), stop_after=STOP)  # interrupted
    tr.save()
    res["interrupted"] = {"step": tr.step, "seen": tr.records_seen, "params": _params(tr)}
    # Resume from rank 0's checkpoint on both ranks (it names run0 as out_dir) and train to the end.
    rt = Trainer.load(tmp_p / "run0" / "checkpoint.pt")
    rt.fit(epoch_stream(ds, EPOCHS, 0))
    rt.finish()
    res["final"] = {"step": rt.step, "seen": rt.records_seen, "params": _params(rt),
                    "loss": [h["loss"] for h in rt.log.history]}
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


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str, rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.allclose(a[n], b[n], rtol=rtol, atol=rtol / 100), (what, n, (a[n] - b[n]).abs().max())


_CUDA2 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                            reason="nccl variant needs 2 CUDA devices")


@pytest.mark.parametrize("kind,device", [("eagle3", "cpu"), ("dflash", "cpu"),
                                         pytest.param("eagle3", "cuda", marks=_CUDA2),
                                         pytest.param("dflash", "cuda", marks=_CUDA2)])
def test_two_ranks_equal_one_process(kind, device, tmp_path):
    ds_dir = _dataset(tmp_path / "ds")
    res = _launch(kind, tmp_path, device)
    ds = load_records(ds_dir)
    rtol = 1e-4 if device == "cpu" else 1e-3  # fp32 both; CUDA kernels pick reduction orders by shape

    # The same global batch in one process: interrupted at STOP, then on to the end of the stream.
    one = _make(kind, tmp_path / "single", ds, device=device)
    one.fit(epoch_stream(ds, EPOCHS, 0), stop_after=STOP)
    at_stop = (one.step, one.records_seen, _params(one))
    one.fit(epoch_stream(ds, EPOCHS, 0))
    assert one.step == 6  # 5 full global batches and a final one of a single record (rank 1 idle)

    for r in range(WORLD):
        assert (res[r]["interrupted"]["step"], res[r]["interrupted"]["seen"]) == at_stop[:2]
        _close(res[r]["interrupted"]["params"], at_stop[2], f"rank {r} at step {STOP}", rtol)
        assert (res[r]["final"]["step"], res[r]["final"]["seen"]) == (one.step, one.records_seen)
    # Both ranks hold bit-identical parameters after every step (summed gradients, same update).
    for a in ("interrupted", "final"):
        for n, t in res[0][a]["params"].items():
            assert torch.equal(t, res[1][a]["params"][n]), (a, n)

    # Rank 0's final checkpoint (after the resume) matches the single process; history spans both legs.
    sd = torch.load(tmp_path / "run0" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert sd["step"] == one.step and sd["records_seen"] == one.records_seen
    _close(sd["model"], _params(one), "final checkpoint", rtol)
    losses = [h["loss"] for h in sd["history"]]
    assert losses == pytest.approx([h["loss"] for h in one.log.history], rel=rtol)
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


def _bad_worker(rank: int, port: int, tmp: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
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
