"""The run report: ``report.json`` (everything), ``report.md`` (acceptance table, rates, idle fraction)
and ``report.png`` (loss, teacher-forced accuracy per draft position, served acceptance vs step)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from layertap.pipeline.config import PipelineConfig


def acceptance_table(final: dict[str, Any]) -> str:
    """Markdown table from ``run_eval``'s results (vLLM's own counters)."""
    rows = ["| drafter | mean acceptance length | per-position acceptance | drafts | outputs == plain |",
            "|---|---|---|---|---|"]
    for r in final.get("results", []):
        pos = " ".join(f"{p:.2f}" for p in r["per_pos"])
        same = {True: "yes", False: f"no ({len(r['mismatches'])} differ)", None: "-"}[r.get("outputs_match_plain")]
        rows.append(f"| {r['name']} | {r['mean_acceptance_length']:.3f} | {pos} | {r['drafts']} | {same} |")
    return "\n".join(rows)


def rates_table(rates: dict[str, Any]) -> str:
    rows = ["| measure | value |", "|---|---|"]
    rows += [f"| {k} | {v} |" for k, v in rates.items()]
    return "\n".join(rows)


def curve(evals: list[dict[str, Any]], name: str) -> list[tuple[int, float]]:
    pts = []
    for e in evals:
        for r in e.get("results", []):
            if r["name"] == name:
                pts.append((int(e["step"]), float(r["mean_acceptance_length"])))
    return sorted(set(pts))


def plot(path: Path, history: list[dict[str, Any]], evals: list[dict[str, Any]], kind: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt

    from layertap.train.metrics import _smooth

    steps = [m["step"] for m in history]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(steps, [m["loss"] for m in history])
    axes[0].set_yscale("log"), axes[0].set_xlabel("step"), axes[0].set_title("training loss")
    for j in range(len(history[0]["acc"]) if history else 0):
        axes[1].plot(steps, _smooth([m["acc"][j] for m in history]), label=f"pos {j}")
    axes[1].set_ylim(0, 1), axes[1].set_xlabel("step"), axes[1].set_title("teacher-forced accuracy")
    axes[1].legend(fontsize=7)
    pts = curve(evals, kind)
    if pts:
        axes[2].plot([s for s, _ in pts], [a for _, a in pts], "o-", label=kind)
    for s, a in curve(evals, "ngram"):
        axes[2].axhline(a, color="gray", linestyle="--", label="ngram")
    axes[2].set_xlabel("step"), axes[2].set_title("mean acceptance length in vLLM"), axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


_SUMMED = ("submitted", "records", "rejected", "retried", "producer_wall_s", "producer_tokens", "consumer_records",
           "consumer_wall_s", "consumer_tokens", "trainer_startup_wait_s", "trainer_idle_s")


def combine_rates(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One ``Rates.summary()`` over the parts of a run (each invocation of a resumed run, ``PARTS``): counts
    and walls summed, per-second rates and the idle fraction from the sums. Parts that ended without
    writing rates (killed) are left out; ``parts`` in the report lists them."""
    rs = [p["rates"] for p in parts if p.get("rates")]
    if not rs:
        return {}
    t = {k: sum(r[k] for r in rs) for k in _SUMMED}
    prod, cons = max(t["producer_wall_s"], 1e-9), max(t["consumer_wall_s"], 1e-9)
    return {**{k: (round(v, 2) if isinstance(v, float) else v) for k, v in t.items()},
            "producer_records_per_s": round(t["records"] / prod, 2),
            "producer_tokens_per_s": round(t["producer_tokens"] / prod, 1),
            "consumer_records_per_s": round(t["consumer_records"] / cons, 2),
            "consumer_tokens_per_s": round(t["consumer_tokens"] / cons, 1),
            "trainer_idle_fraction": round(t["trainer_idle_s"] / cons, 4), "parts": len(rs)}


def write_report(out: Path, cfg: PipelineConfig, plan: Any, tr: Any, rates: Any, evals: Any,
                 final: dict[str, Any], *, wall_s: float, checkpoint: Path,
                 parts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``parts``: every invocation of the run so far (``run.PARTS``; this one last). ``rates`` is this
    invocation's; ``rates_total`` sums them over the parts, so a resumed run reports all its capture and
    training, not only its last part's."""
    r = rates.summary()
    parts = parts or [{"part": 1, "status": "done", "rates": r}]
    rep = {
        "drafter": cfg.drafter, "target": plan.target, "layers": plan.layers, "mode": plan.mode,
        "transport": cfg.capture.transport, "steps": tr.step, "inputs_trained": len(tr.tcfg.extra["consumed"]),
        "wall_s": round(wall_s, 1), "rates": r, "rates_total": combine_rates(parts), "parts": parts,
        "wall_s_total": round(sum(p.get("wall_s") or 0.0 for p in parts), 1),
        "rejected": rates.rejected, "retried": rates.retried,
        "acceptance": final, "acceptance_curve": evals.results, "evals_skipped": evals.skipped,
        "checkpoint": str(checkpoint), "export": str(out / "exports" / "final"),
        "final_loss": tr.log.history[-1]["loss"] if tr.log.history else None,
    }
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    plot(out / "report.png", tr.log.history, evals.results, cfg.drafter)
    md = [f"# layertap train: {cfg.drafter}", "",
          f"target `{plan.target}`, layers {plan.layers}, {plan.mode} mode, transport {cfg.capture.transport}; "
          f"{tr.step} steps over {rep['inputs_trained']} inputs in {rep['wall_s']} s wall"
          + (f" ({len(parts)} invocations, {rep['wall_s_total']} s in all)." if len(parts) > 1 else "."), "",
          "## Acceptance in vLLM (held-out prompts, greedy)", "",
          acceptance_table(final) if final else "(evaluation disabled)", "",
          "## Producer / consumer" + (" (summed over the run's invocations)" if len(parts) > 1 else ""), "",
          rates_table(rep["rates_total"] if len(parts) > 1 else r), "",
          "Idle fraction = time the trainer waited for a record / time since the first record "
          "(the engine's start-up wait is reported apart).", "",
          "![curves](report.png)", ""]
    (out / "report.md").write_text("\n".join(md))
    return rep
