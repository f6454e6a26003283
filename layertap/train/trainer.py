"""One trainer for both drafters and both sources.

Entry point: ``Trainer.fit(records)`` with any ``Iterable[Record]`` (a ``FileDataset``, a shuffled
epoch stream over it, ``Tap.capture(...)``, or a transport ``Source`` drained into a generator). The
trainer counts records consumed; ``state_dict`` holds model, optimizer, step, that count and the anchor
RNG, so resuming with the same re-iterable source (it skips the consumed prefix) continues bit-exactly.

Numerics: EAGLE-3 labels are the target's soft distribution, ``softmax(lm_head(final_norm(h_N)))``
restricted to the draft vocabulary and renormalised (forward KL up to a constant); DFlash trains on the
sequence tokens, which in regenerate mode are the target's greedy choices.

Several ranks (``torchrun``; see ``layertap.train.dist``): ``batch_size`` is the global batch, split
evenly over the ranks; every rank reads the same record stream and trains on its rows of each global
batch (``shard_batches``). Each drafter step loss is a mean over trained positions, so a rank's loss is
re-weighted by its own position count over the all-reduced global count, and gradients are summed:
N ranks then compute the gradient of the single-process batch (to float rounding). DFlash anchors are
drawn for the whole global batch on every rank, as one process would. Only rank 0 writes files.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any, Iterable

import torch

from layertap.drafters.dflash import DFlashDrafter, sample_anchors
from layertap.drafters.eagle3 import Eagle3Drafter, StepStats
from layertap.models.head import TargetHead, load_tensors
from layertap.records import Record
from layertap.train import dist as tdist
from layertap.train.config import DFlashConfig, DrafterShape, Eagle3Config, TrainConfig
from layertap.train.data import Batch, Shard, batches, shard_batches
from layertap.train.metrics import MetricsLog

CKPT = "checkpoint.pt"


def config_from_dict(kind: str, d: dict[str, Any]) -> Eagle3Config | DFlashConfig:
    d = dict(d)
    d["shape"] = DrafterShape(**d["shape"])
    if kind == "eagle3":
        return Eagle3Config(**d)
    if kind == "dflash":
        return DFlashConfig(**d)
    raise ValueError(f"drafter kind must be 'eagle3' or 'dflash', got {kind!r}")


def build_drafter(kind: str, cfg: Eagle3Config | DFlashConfig, target: str | Path,
                  draft_ids: torch.Tensor | None = None) -> torch.nn.Module:
    emb = load_tensors(target, ["model.embed_tokens.weight"])["model.embed_tokens.weight"].float()
    if kind == "eagle3":
        if draft_ids is None:
            raise ValueError("build_drafter: eagle3 needs draft_ids (see draft_vocab_from_counts)")
        return Eagle3Drafter(cfg, emb, draft_ids)
    head = TargetHead.from_pretrained(target)
    return DFlashDrafter(cfg, emb, head.lm_head.float(), head.norm_weight.float())


class Trainer:
    def __init__(self, kind: str, cfg: Eagle3Config | DFlashConfig, tcfg: TrainConfig, target: str | Path,
                 draft_ids: torch.Tensor | None = None):
        torch.manual_seed(tcfg.seed)
        self.kind, self.cfg, self.tcfg, self.target = kind, cfg, tcfg, str(target)
        self.dist = tdist.setup(tcfg.device)
        """Rank, world size, backend and device when running on several ranks; None in one process."""
        self.is_main = self.dist is None or self.dist.is_main
        if self.dist is not None and tcfg.batch_size % self.dist.world_size:
            raise tdist.DistSetupError(
                f"batch_size={tcfg.batch_size} (records per step over all ranks) is not divisible by the world "
                f"size {self.dist.world_size}: use a multiple of {self.dist.world_size}")
        self.device = self.dist.device if self.dist is not None else torch.device(tcfg.device)
        self.model = build_drafter(kind, cfg, target, draft_ids).to(self.device)
        if self.dist is not None:
            tdist.broadcast_module(self.model)
        self.head = TargetHead.from_pretrained(target).to(self.device) if kind == "eagle3" else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay)
        self.step = 0
        self.records_seen = 0
        self.gen = torch.Generator().manual_seed(tcfg.seed)  # DFlash anchor sampling
        self.log = MetricsLog(Path(tcfg.out_dir), tensorboard=tcfg.tensorboard and self.is_main)
        if self.dist is not None and self.is_main:
            d = self.dist
            print(f"data-parallel training: world size {d.world_size}, backend {d.backend}, "
                  f"{tcfg.batch_size // d.world_size} records per rank per step ({tcfg.batch_size} per step)",
                  flush=True)

    # -- bookkeeping -------------------------------------------------------------------------------
    def lr_at(self, step: int) -> float:
        t = self.tcfg
        if step < t.warmup_steps:
            return t.lr * (step + 1) / t.warmup_steps
        frac = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
        return t.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "config": asdict(self.cfg), "train_config": self.tcfg.to_dict(),
            "target": self.target, "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
            "step": self.step, "records_seen": self.records_seen, "gen": self.gen.get_state(),
            "history": self.log.history, "torch_rng": torch.get_rng_state(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["kind"] != self.kind:
            raise ValueError(f"checkpoint is a {sd['kind']} drafter, this trainer trains {self.kind}")
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optimizer"])
        self.step, self.records_seen = int(sd["step"]), int(sd["records_seen"])
        self.gen.set_state(sd["gen"])
        torch.set_rng_state(sd["torch_rng"])
        self.log.history = sd["history"]
        if self.dist is not None:
            tdist.broadcast_module(self.model)

    def save(self, path: str | Path | None = None) -> Path:
        """Write the checkpoint. On several ranks this is collective (call it on every rank): rank 0
        writes, and every rank returns once the file is complete."""
        p = Path(path or Path(self.tcfg.out_dir) / CKPT)
        try:
            if self.is_main:
                p.parent.mkdir(parents=True, exist_ok=True)
                tmp = p.with_suffix(".tmp")
                torch.save(self.state_dict(), tmp)
                tmp.replace(p)  # atomic: a crash mid-save keeps the previous checkpoint
        finally:
            if self.dist is not None:
                tdist.barrier()
        return p

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "Trainer":
        """Rebuild a trainer from a checkpoint; ``overrides`` replace TrainConfig fields (e.g. max_steps)."""
        sd = torch.load(path, map_location="cpu", weights_only=False)
        tcfg = TrainConfig(**{**sd["train_config"], **overrides})
        cfg = config_from_dict(sd["kind"], sd["config"])
        draft_ids = sd["model"].get("draft_ids")
        tr = cls(sd["kind"], cfg, tcfg, sd["target"], draft_ids)
        tr.load_state_dict(sd)
        return tr

    # -- training ----------------------------------------------------------------------------------
    def _layer_ids(self) -> tuple[list[int], int | None]:
        if isinstance(self.cfg, Eagle3Config):
            return list(self.cfg.aux_layer_ids), self.cfg.last_layer_id
        return self.cfg.aux_layer_ids, None

    def _num_stats(self) -> int:
        return self.cfg.ttt_steps if isinstance(self.cfg, Eagle3Config) else self.cfg.block_size - 1

    def losses(self, b: Batch, anchors: torch.Tensor | None = None) -> list[StepStats]:
        if isinstance(self.model, Eagle3Drafter):
            with torch.no_grad():
                logits = self.head(b.last)
                top = logits.argmax(-1)
                p = torch.softmax(logits[..., self.model.draft_ids].float(), dim=-1)
            return self.model(b.aux, b.ids, p, top, b.mask)
        if anchors is None:
            anchors = sample_anchors(b.mask, b.lengths, self.cfg.anchors_per_seq, self.gen)
        return self.model(b.aux, b.ids, b.mask, b.lengths, anchors.to(self.device))

    def train_step(self, b: Batch) -> dict[str, Any]:
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        use_bf16 = self.device.type == "cuda" and self.tcfg.dtype == "bfloat16"
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
            stats = self.losses(b.to(self.device))
        loss = sum(s.loss for s in stats)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        self.opt.step()
        self.step += 1
        cnt = [max(float(s.count), 1.0) for s in stats]
        return {"loss": loss.item(), "lr": self.lr_at(self.step - 1),
                "acc": [float(s.correct) / c for s, c in zip(stats, cnt)],
                "chain": [float(s.chain) / c for s, c in zip(stats, cnt)],
                "tokens": int(b.lengths.sum())}

    def dist_step(self, sh: Shard) -> dict[str, Any]:
        """One optimizer step on several ranks: this rank's rows of a global batch (maybe none)."""
        d = self.dist
        assert d is not None, "dist_step needs a process group (use train_step in one process)"
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        k = self._num_stats()
        anchors = None
        if self.kind == "dflash":  # drawn for the whole global batch, as one process would, then sliced
            anchors = sample_anchors(sh.mask, sh.lengths, self.cfg.anchors_per_seq, self.gen)[d.rank :: d.world_size]
        self.opt.zero_grad(set_to_none=True)
        use_bf16 = self.device.type == "cuda" and self.tcfg.dtype == "bfloat16"
        stats = None
        local = torch.zeros(3 * k + 1, dtype=torch.float64, device=self.device)
        if sh.batch is not None:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_bf16):
                stats = self.losses(sh.batch.to(self.device), anchors)
            local[:k] = torch.stack([s.count for s in stats]).double()
            local[k : 2 * k] = torch.stack([s.correct for s in stats]).double()
            local[2 * k : 3 * k] = torch.stack([s.chain for s in stats]).double()
            local[3 * k] = float(sh.batch.lengths.sum())
        tot = tdist.all_reduce(local)
        count = tot[:k]
        params = [p for p in self.model.parameters() if p.requires_grad]
        loss_val = torch.zeros(1, dtype=torch.float64, device=self.device)
        if stats is not None:
            # Each step loss is sum(loss * w) / max(count, 1) over this rank's rows; scaled to the global
            # count, the ranks' losses (and gradients) sum to the single-process batch's.
            loss = sum(s.loss * s.count.clamp(min=1.0) / count[j].clamp(min=1.0).to(s.loss.dtype)
                       for j, s in enumerate(stats))
            loss.backward()
            loss_val[0] = loss.detach().double()
        head = torch.cat([torch.tensor([float(p.grad is not None) for p in params], dtype=torch.float64,
                                       device=self.device), loss_val])
        head = tdist.all_reduce(head)
        for p, used in zip(params, head[:-1].tolist()):
            if not used:  # no rank touched it: no gradient, as in one process
                p.grad = None
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            tdist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        self.opt.step()
        self.step += 1
        cnt = count.clamp(min=1.0)
        return {"loss": float(head[-1]), "lr": self.lr_at(self.step - 1),
                "acc": (tot[k : 2 * k] / cnt).tolist(), "chain": (tot[2 * k : 3 * k] / cnt).tolist(),
                "tokens": int(tot[3 * k])}

    def fit(self, records: Iterable[Record], *, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps`` (or ``stop_after`` steps, leaving the schedule planned for
        ``max_steps``: an interruption) or the source ends; skips records consumed before a resume.
        On several ranks every rank passes the same stream; all stop together when any runs out."""
        aux_ids, last_id = self._layer_ids()
        skip = self.records_seen
        stream = islice(iter(records), skip, None)
        if self.dist is not None:
            return self._fit_dist(stream, skip, stop_after)
        t0 = time.monotonic()
        for b, seen in batches(stream, self.tcfg.batch_size, aux_ids, last_id, self.tcfg.max_len, self.device):
            if self.step >= min(self.tcfg.max_steps, stop_after or self.tcfg.max_steps):
                break
            m = self.train_step(b)
            self.records_seen = skip + seen
            m["step"], m["tok_per_s"] = self.step, m["tokens"] / max(time.monotonic() - t0, 1e-9)
            t0 = time.monotonic()
            self.log.add(m, echo=self.step % self.tcfg.log_every == 0 or self.step == 1)
            if self.tcfg.save_every and self.step % self.tcfg.save_every == 0:
                self.save()
        return self.log.history

    def _fit_dist(self, stream: Iterable[Record], skip: int, stop_after: int | None) -> list[dict[str, Any]]:
        d = self.dist
        aux_ids, last_id = self._layer_ids()
        limit = min(self.tcfg.max_steps, stop_after or self.tcfg.max_steps)
        shards = shard_batches(stream, self.tcfg.batch_size, d.rank, d.world_size, aux_ids, last_id,
                               self.tcfg.max_len, self.device)
        first, warned = True, False
        t0 = time.monotonic()
        while self.step < limit:
            sh = next(shards, None)
            # One all-reduce (min) agrees on going on: [have a batch, its global size, seen, -seen].
            have = sh is not None
            flag = torch.tensor([float(have), sh.global_size if have else 0.0, sh.seen if have else 0.0,
                                 -sh.seen if have else 0.0], dtype=torch.float64, device=self.device)
            have_all, gsize, seen_min, neg_seen_max = tdist.all_reduce(flag, "min").tolist()
            if not have_all:
                break  # some rank's stream ended: every rank stops at this same step
            if seen_min != -neg_seen_max and not warned and self.is_main:
                warned = True
                warnings.warn(f"ranks read different record streams (consumed {int(seen_min)} vs "
                              f"{int(-neg_seen_max)} records by step {self.step + 1}): records_seen counts the "
                              "longest, so a resume is not exact; pass every rank the same stream, the trainer "
                              "shards it", stacklevel=2)
            if first and skip == 0 and gsize < d.world_size:
                raise tdist.DistSetupError(
                    f"world size {d.world_size} exceeds the {int(gsize)} trainable record(s) in the data: "
                    f"run on at most {int(gsize)} rank(s)")
            first = False
            m = self.dist_step(sh)
            self.records_seen = skip + int(-neg_seen_max)
            m["step"], m["tok_per_s"] = self.step, m["tokens"] / max(time.monotonic() - t0, 1e-9)
            t0 = time.monotonic()
            self.log.add(m, echo=self.is_main and (self.step % self.tcfg.log_every == 0 or self.step == 1))
            if self.tcfg.save_every and self.step % self.tcfg.save_every == 0:
                self.save()
        return self.log.history

    def finish(self) -> Path:
        """Final checkpoint + PNG plot + history JSON; returns the checkpoint path. On several ranks
        rank 0 writes them and every rank returns once they are written."""
        try:
            ckpt = self.save()
            if self.is_main:
                self.log.plot(Path(self.tcfg.out_dir) / "training.png", title=f"{self.kind} drafter")
                (Path(self.tcfg.out_dir) / "history.json").write_text(json.dumps(self.log.history))
            self.log.close()
        finally:
            if self.dist is not None:
                tdist.barrier()
        return ckpt
