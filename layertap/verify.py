"""Independent recomputation with HF transformers: the user's proof that records are right.

For each record: run the HF model on the record's token ids, take layer id ``i`` as
``output_hidden_states[i]`` for ``i < N`` and, for ``i = N``, the *input* of the final norm (HF's last
entry is after the norm, the capture is before it). Compare per token and layer: min cosine and max abs
error. A record fails when any token's cosine is below the threshold.

Half-precision records of deep models: an engine computing in bf16 drifts from an fp32 reference as depth
grows, by rounding alone. On an 8B-shaped random model (hidden 4096, 32 layers) the worst per-token cosine of
HF's *own* bf16 pass against its fp32 pass is 0.9991 at layer 16 and 0.9982 at layer 32 (H200, RESULTS
2026-12-03), below the 0.999 that fits small models. So for bf16 / fp16 records the reference runs twice,
in fp32 and in the records' dtype, and each record and layer is allowed the larger of ``1 - threshold`` and
``noise_factor`` x HF's own half-precision error on the same tokens (its worst token's ``1 - cosine``
against fp32): the noise floor. Rows of another request, token or layer are off by far more than rounding
(cosines near 0 to 0.99), so the floor does not let the bug classes through; it only stops rounding from
being reported as a mismatch.
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
    noise_min_cos: float | None = None  # HF's own half-precision pass vs its fp32 pass (the noise floor)
    allowed_min_cos: float | None = None  # the lowest cosine any record was allowed at this layer
    failed: int = 0  # records that fell below what they were allowed at this layer


@dataclass
class VerifyReport:
    threshold: float
    layer_ids: list[int]
    per_layer: dict[int, LayerStat] = field(default_factory=dict)
    records: int = 0
    tokens: int = 0
    failures: list[str] = field(default_factory=list)
    noise_factor: float = 2.0
    noise_dtype: str | None = None  # the half-precision dtype of the noise-floor pass, when one ran

    @property
    def ok(self) -> bool:
        return self.records > 0 and not self.failures

    def allowed(self, noise_min_cos: float | None) -> float:
        """The lowest cosine a record may show at a layer: the threshold, or lower by the noise floor."""
        if noise_min_cos is None:
            return self.threshold
        return min(self.threshold, 1.0 - self.noise_factor * (1.0 - noise_min_cos))

    def add(self, rec: Record, cos: torch.Tensor, err: torch.Tensor, noise: torch.Tensor | None = None) -> None:
        """``cos``/``err``: [tokens, layers] for one record; ``noise``: the same shape, HF's half-precision
        pass against the reference (None: no noise floor)."""
        self.records += 1
        self.tokens += cos.shape[0]
        for j, lid in enumerate(rec.layer_ids):
            s = self.per_layer.setdefault(lid, LayerStat())
            s.min_cos = min(s.min_cos, float(cos[:, j].min()))
            s.max_abs = max(s.max_abs, float(err[:, j].max()))
            s.tokens += cos.shape[0]
            floor = float(noise[:, j].min()) if noise is not None else None
            allowed = self.allowed(floor)
            if floor is not None:
                s.noise_min_cos = floor if s.noise_min_cos is None else min(s.noise_min_cos, floor)
            s.allowed_min_cos = allowed if s.allowed_min_cos is None else min(s.allowed_min_cos, allowed)
            if float(cos[:, j].min()) < allowed:
                s.failed += 1
                t = int(cos[:, j].argmin())
                why = (f"< {allowed:.5f} (threshold {self.threshold}; HF's own {self.noise_dtype} pass: {floor:.5f})"
                       if floor is not None else f"< {self.threshold}")
                self.failures.append(f"record {rec.key} (index {rec.index}) layer {lid}: token {t} cosine "
                                     f"{float(cos[t, j]):.5f} {why}")


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


HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def noise_dtype_for(rec: Record, reference: torch.dtype, choice: str | None) -> torch.dtype | None:
    """The dtype of the noise-floor pass: ``choice`` "auto" takes the records' own dtype when it is bf16 or
    fp16 and the reference is fp32; a dtype name forces it; "off" / None runs none."""
    if choice in (None, "off") or reference != torch.float32:
        return None
    if choice == "auto":
        return rec.hidden_states.dtype if rec.hidden_states.dtype in HALF.values() else None
    if choice not in HALF:
        raise ValueError(f"noise dtype {choice!r}: expected auto, off or one of {sorted(HALF)}")
    return HALF[choice]


def verify_records(records: Iterable[Record], model_path: str | os.PathLike, *, threshold: float = 0.999,
                   dtype: torch.dtype = torch.float32, progress: bool = True, limit: int | None = None,
                   noise: str | None = "auto", noise_factor: float = 2.0) -> VerifyReport:
    """Recompute each record with HF in ``dtype`` and compare (module docstring). ``noise``: the noise-floor
    pass ("auto": in the records' dtype when they are bf16 / fp16; "bfloat16" / "float16"; "off")."""
    from tqdm import tqdm

    if noise_factor < 1.0:
        raise ValueError(f"noise_factor {noise_factor}: must be >= 1 (a record may drift at least as much as HF's own pass)")
    ref_model = HFReference(model_path, dtype=dtype)
    half: HFReference | None = None
    report: VerifyReport | None = None
    it = tqdm(records, desc="verify", unit="rec", disable=not progress)
    for n, rec in enumerate(it):
        if limit is not None and n >= limit:
            break
        rec.check()
        nd = noise_dtype_for(rec, dtype, noise)
        if report is None:
            report = VerifyReport(threshold, list(rec.layer_ids), noise_factor=noise_factor,
                                  noise_dtype=str(nd).removeprefix("torch.") if nd is not None else None)
        ref = ref_model.planes(rec.token_ids, rec.layer_ids)
        cos, err = compare(rec, ref)
        floor = None
        if nd is not None:
            if half is None or half.model.dtype != nd:
                half = HFReference(model_path, dtype=nd, device=ref_model.device)
            floor = row_cosine(half.planes(rec.token_ids, rec.layer_ids).float(), ref.float())
            pos = getattr(rec, "positions", None)
            floor = (floor[pos.to(floor.device)] if pos is not None else floor).cpu()
        report.add(rec, cos, err, floor)
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
    if report.noise_dtype:
        t.add_column(f"HF {report.noise_dtype} vs fp32", justify="right")
        t.add_column("allowed", justify="right")
    t.add_column("result")
    for lid in sorted(report.per_layer):
        s = report.per_layer[lid]
        allowed = s.allowed_min_cos if s.allowed_min_cos is not None else report.threshold
        good = s.failed == 0
        extra = ([f"{s.noise_min_cos:.6f}" if s.noise_min_cos is not None else "-", f"{allowed:.6f}"]
                 if report.noise_dtype else [])
        t.add_row(str(lid), str(s.tokens), f"{s.min_cos:.6f}", f"{s.max_abs:.3e}", *extra,
                  "[green]match[/green]" if good else "[red]MISMATCH[/red]")
    console.print(t)
    for f in report.failures[:10]:
        console.print(f"[red]{f}[/red]")
    if len(report.failures) > 10:
        console.print(f"[red]... and {len(report.failures) - 10} more[/red]")
    if report.records == 0:
        console.print("[red]no records to verify[/red]")
    console.print("[bold green]ALL RECORDS MATCH[/bold green]" if report.ok else "[bold red]VERIFY FAILED[/bold red]")
