"""One trainer for both drafters and both sources.

Entry point: ``Trainer.fit(records)`` with any ``Iterable[Record]`` (a ``FileDataset``, a shuffled
epoch stream over it, ``Tap.capture(...)``, or a transport ``Source`` drained into a generator). The
trainer counts records consumed; ``state_dict`` holds model, optimizer, step, that count and the anchor
RNG, so resuming with the same re-iterable source (it skips the consumed prefix) continues bit-exactly.

Numerics: EAGLE-3 labels are the target's soft distribution, ``softmax(lm_head(final_norm(h_N)))``
restricted to the draft vocabulary and renormalised (forward KL up to a constant); DFlash trains on the
sequence tokens, which in regenerate mode are the target's greedy choices.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from itertools import islice
from pathlib import Path
from typing import Any, Iterable

import torch

from layertap.drafters.dflash import DFlashDrafter, sample_anchors
from layertap.drafters.eagle3 import Eagle3Drafter, StepStats
from layertap.models.head import TargetHead, load_tensors
from layertap.records import Record
from layertap.train.config import DFlashConfig, DrafterShape, Eagle3Config, TrainConfig
from layertap.train.data import Batch, batches
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
        self.device = torch.device(tcfg.device)
        self.model = build_drafter(kind, cfg, target, draft_ids).to(self.device)
        self.head = TargetHead.from_pretrained(target).to(self.device) if kind == "eagle3" else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=tcfg.lr, betas=(0.9, 0.95), weight_decay=tcfg.weight_decay)
        self.step = 0
        self.records_seen = 0
        self.gen = torch.Generator().manual_seed(tcfg.seed)  # DFlash anchor sampling
        self.log = MetricsLog(Path(tcfg.out_dir), tensorboard=tcfg.tensorboard)

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

    def save(self, path: str | Path | None = None) -> Path:
        p = Path(path or Path(self.tcfg.out_dir) / CKPT)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        tmp.replace(p)  # atomic: a crash mid-save keeps the previous checkpoint
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

    def losses(self, b: Batch) -> list[StepStats]:
        if isinstance(self.model, Eagle3Drafter):
            with torch.no_grad():
                logits = self.head(b.last)
                top = logits.argmax(-1)
                p = torch.softmax(logits[..., self.model.draft_ids].float(), dim=-1)
            return self.model(b.aux, b.ids, p, top, b.mask)
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

    def fit(self, records: Iterable[Record], *, stop_after: int | None = None) -> list[dict[str, Any]]:
        """Train until ``max_steps`` (or ``stop_after`` steps, leaving the schedule planned for
        ``max_steps``: an interruption) or the source ends; skips records consumed before a resume."""
        aux_ids, last_id = self._layer_ids()
        skip = self.records_seen
        stream = islice(iter(records), skip, None)
        t0 = time.monotonic()
        for b, seen in batches(stream, self.tcfg.batch_size, aux_ids, last_id, self.tcfg.max_len):
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

    def finish(self) -> Path:
        """Final checkpoint + PNG plot + history JSON; returns the checkpoint path."""
        ckpt = self.save()
        self.log.plot(Path(self.tcfg.out_dir) / "training.png", title=f"{self.kind} drafter")
        (Path(self.tcfg.out_dir) / "history.json").write_text(json.dumps(self.log.history))
        self.log.close()
        return ckpt
