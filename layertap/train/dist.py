"""Data-parallel set-up for the drafter trainer (``torch.distributed``, one process per rank).

A run is distributed when a process group is already initialised, or when the launcher's environment
says so (``torchrun``: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, with
``WORLD_SIZE > 1``). The backend is ``nccl`` on CUDA (each rank on ``cuda:LOCAL_RANK``) and ``gloo`` on
CPU; the CPU path makes no CUDA call. Gradients are summed with explicit all-reduces (no DDP wrapper),
so checkpoints hold the bare drafter's parameter names and load in one process unchanged.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from layertap.data import InputError


class DistSetupError(InputError):
    """A multi-rank set-up the trainer cannot run (the message names the problem)."""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        raise DistSetupError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def setup(device: str | torch.device) -> DistInfo | None:
    """Join (or start) the process group when this process is one of several ranks; ``None`` for a plain
    single-process run. ``device`` is the configured training device; on CUDA the rank's device is
    ``cuda:LOCAL_RANK``."""
    dev = torch.device(device)
    if not dist.is_available():
        if _env_world_size() > 1:
            raise DistSetupError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
        return None
    if not dist.is_initialized():
        if _env_world_size() <= 1:
            return None
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise DistSetupError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: "
                                 "launch with torchrun (e.g. torchrun --nproc-per-node 2 -m layertap.cli ...)")
        if dev.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", "0"))
            n = torch.cuda.device_count()
            if local >= n:
                raise DistSetupError(f"LOCAL_RANK={local} but only {n} CUDA device(s) are visible: "
                                     "use at most one rank per GPU (--nproc-per-node)")
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        elif dev.type == "cpu":
            dist.init_process_group("gloo")
        else:
            raise DistSetupError(f"multi-rank training supports cpu (gloo) and cuda (nccl), not {dev.type}")
        atexit.register(_destroy)  # this process started the group, so it also ends it
    backend = str(dist.get_backend())
    if dev.type == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
        if "nccl" not in backend:
            raise DistSetupError(f"training on cuda needs the nccl process group backend, got {backend}")
    elif dev.type == "cpu":
        if "gloo" not in backend:
            raise DistSetupError(f"training on cpu needs the gloo process group backend, got {backend}")
    else:
        raise DistSetupError(f"multi-rank training supports cpu (gloo) and cuda (nccl), not {dev.type}")
    return DistInfo(dist.get_rank(), dist.get_world_size(), backend, dev)


def _destroy() -> None:
    """At exit: wait for the other ranks, then end the group. Without the barrier a rank that leaves first
    (rank 0 also hosts the rendezvous store) can make a slower peer's gloo threads abort (SIGABRT, seen in
    tests/unit/test_trainer_ddp.py about one run in three)."""
    if not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=30))
        else:
            dist.barrier()
    except Exception:  # noqa: BLE001 - a peer is already gone: nothing left to wait for
        pass
    dist.destroy_process_group()


def all_reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of ``t`` over every rank (``op``: sum | min | max); returns ``t``."""
    dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return t


def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers to every rank (identical start, whatever each rank built)."""
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src)


def barrier() -> None:
    dist.barrier()
