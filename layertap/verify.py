"""Independent recomputation with HF transformers: the user's proof that records are right.

For each record: run the HF model on the record's token ids, take layer id ``i`` as
``output_hidden_states[i]`` for ``i < N`` and, for ``i = N``, the *input* of the final norm (HF's last
entry is after the norm, the capture is before it). Compare per token and layer: min cosine and max abs
error. A record fails when any token's cosine is below the threshold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable

import torch

from layertap.records import Record


@dataclass
class LayerStat:
    min_cos: float = 1.0
    max_abs: float = 0.0
    tokens: int = 0


@dataclass
class VerifyReport:
    threshold: float
    layer_ids: list[int]
    per_layer: dict[int, LayerStat] = field(default_factory=dict)
    records: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.records > 0 and not self.failures

    def add(self, rec: Record, cos: torch.Tensor, err: torch.Tensor) -> None:
        """``cos``/``err``: [tokens, layers] for one record."""
        self.records += 1
        self.tokens += cos.shape[0]
        for j, lid in enumerate(rec.layer_ids):
            s = self.per_layer.setdefault(lid, LayerStat())
            s.min_cos = min(s.min_cos, float(cos[:, j].min()))
            s.max_abs = max(s.max_abs, float(err[:, j].max()))
            s.tokens += cos.shape[0]
            if float(cos[:, j].min()) < self.threshold:
                t = int(cos[:, j].argmin())
                self.failures.append(f"record {rec.key} (index {rec.index}) layer {lid}: token {t} cosine "
                                     f"{float(cos[t, j]):.5f} < {self.threshold}")


class HFReference:
    """An HF model that yields reference planes for given token ids and layer ids."""

    def __init__(self, model_path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str | None = None):
        from transformers import AutoModelForCausalLM

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(self.device).eval()
        self.n_layers = self.model.config.num_hidden_layers
        self._pre_norm: torch.Tensor | None = None
        norm = self.model.model.norm
        norm.register_forward_hook(lambda mod, inp, out: setattr(self, "_pre_norm", inp[0]))

    @torch.no_grad()
    def planes(self, token_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        ids = token_ids.to(self.device, torch.long).unsqueeze(0)
        out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        cols = [self._pre_norm[0] if i == self.n_layers else hs[i][0] for i in layer_ids]
        return torch.stack(cols, dim=1)  # [T, L, H]


def row_cosine(got: torch.Tensor, ref: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Cosine per row (last axis). A row that is zero in both (e.g. the embedding of a padding token,
    whose row in the table is all zeros) counts as a match (1.0); zero in one only counts as 0."""
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
    both_zero = (got.norm(dim=-1) <= eps) & (ref.norm(dim=-1) <= eps)
    return torch.where(both_zero, torch.ones_like(cos), cos)


def compare(rec: Record, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    got = rec.hidden_states.to(ref.device, torch.float32)
    ref = ref.float()
    pos = getattr(rec, "positions", None)
    if pos is not None:  # compacted record: rows only at these token positions
        ref = ref[pos.to(ref.device)]
    if got.shape[0] != ref.shape[0]:
        raise ValueError(f"record {rec.key}: {got.shape[0]} rows for {ref.shape[0]} reference tokens")
    cos = row_cosine(got, ref)
    err = (got - ref).abs().amax(dim=-1)
    return cos.cpu(), err.cpu()


def verify_records(records: Iterable[Record], model_path: str | os.PathLike, *, threshold: float = 0.999,
                   dtype: torch.dtype = torch.float32, progress: bool = True, limit: int | None = None) -> VerifyReport:
    from tqdm import tqdm

    ref_model = HFReference(model_path, dtype=dtype)
    report: VerifyReport | None = None
    it = tqdm(records, desc="verify", unit="rec", disable=not progress)
    for n, rec in enumerate(it):
        if limit is not None and n >= limit:
            break
        if report is None:
            report = VerifyReport(threshold, list(rec.layer_ids))
        rec.check()
        cos, err = compare(rec, ref_model.planes(rec.token_ids, rec.layer_ids))
        report.add(rec, cos, err)
    return report or VerifyReport(threshold, [])


def print_report(report: VerifyReport, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"layertap verify: {report.records} records, {report.tokens} tokens vs HF transformers")
    t.add_column("layer id", justify="right")
    t.add_column("tokens", justify="right")
    t.add_column("min cosine", justify="right")
    t.add_column("max |error|", justify="right")
    t.add_column("result")
    for lid in sorted(report.per_layer):
        s = report.per_layer[lid]
        good = s.min_cos >= report.threshold
        t.add_row(str(lid), str(s.tokens), f"{s.min_cos:.6f}", f"{s.max_abs:.3e}",
                  "[green]match[/green]" if good else "[red]MISMATCH[/red]")
    console.print(t)
    for f in report.failures[:10]:
        console.print(f"[red]{f}[/red]")
    if len(report.failures) > 10:
        console.print(f"[red]... and {len(report.failures) - 10} more[/red]")
    if report.records == 0:
        console.print("[red]no records to verify[/red]")
    console.print("[bold green]ALL RECORDS MATCH[/bold green]" if report.ok else "[bold red]VERIFY FAILED[/bold red]")
