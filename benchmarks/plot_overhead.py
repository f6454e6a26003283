"""Plot capture's overhead against plain vLLM: every round's ratio as a dot, the median as a bar, the goal as a
line, per in-flight count (prefill, ``capture_overhead.py --json``) or concurrency (serving,
``serve_overhead.py --json``: output throughput and TPOT). A round's ratio compares engines measured seconds
apart; the dots show how far single rounds spread, which a median alone hides.

    python benchmarks/plot_overhead.py benchmarks/results/2026-12-03-s32/capture_overhead.json \\
        benchmarks/results/2026-12-03-s32/serve_overhead.json --out overhead.png

A run stopped from outside still plots: a serving JSON with only its raw rounds, or a prefill run's log
(``capture_overhead.log``: every whole round in it).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def prefill_panels(d: dict) -> list[dict]:
    """One panel: per in-flight count, the per-round ratio of each variant over plain."""
    variants = [v for v in d["args"]["variants"] if v != "plain"]
    series = {}
    for v in variants:
        pts = []
        for row in d["rows"]:
            plain = row.get("plain_rounds") or []
            got = row.get(f"{v}_rounds") or []
            pts.append((str(row["batch"]), [x / p for x, p in zip(got, plain) if p]))
        series[v] = pts
    a = d["args"]
    title = (f"prefill {a['prompts']} x {a['prompt_len']} tokens, hidden {a['hidden']} x {a['num_layers']} layers"
             + (f" ({d['device']})" if d.get("device") else ""))
    return [{"title": title, "xlabel": "requests in flight", "ylabel": "tokens/s, variant / plain",
             "series": series, "goal": 0.97}]


def serve_panels(d: dict) -> list[dict]:
    """Two panels: output throughput ratio and TPOT ratio (capture / plain) per concurrency and round."""
    a = d["args"]
    thr, tpot = {}, {}
    for row in d["rows"]:
        rounds = row["rounds"]
        for v, rs in rounds.items():
            if v == "plain":
                continue
            pairs = list(zip(rs, rounds["plain"]))
            thr.setdefault(v, []).append((str(row["concurrency"]),
                                          [x["output_throughput"] / y["output_throughput"] for x, y in pairs]))
            tpot.setdefault(v, []).append((str(row["concurrency"]),
                                           [x["median_tpot_ms"] / y["median_tpot_ms"] for x, y in pairs]))
    shape = f"serving {a['input_len']} in / {a['output_len']} out, hidden {a['hidden']} x {a['num_layers']} layers"
    return [{"title": shape, "xlabel": "concurrency", "ylabel": "output tokens/s, capture / plain", "series": thr,
             "goal": 0.97},
            {"title": shape, "xlabel": "concurrency", "ylabel": "median TPOT, capture / plain", "series": tpot,
             "goal": 1.03}]


def prefill_from_log(text: str, label: str | None = None) -> dict:
    """A capture_overhead result rebuilt from its log's round lines (``round R/N in-flight B VARIANT: T tok/s``),
    for a run stopped before it wrote its JSON: every round that finished, as the JSON would hold it."""
    import re

    rounds: dict[tuple[int, int], dict[str, float]] = {}
    head = ""
    for line in text.splitlines():
        if line.startswith("capture overhead on "):
            head = line
        m = re.match(r"\s*round (\d+)/\d+ in-flight\s+(\d+)\s+(\S+):\s+([\d.]+) tok/s", line)
        if m:
            rounds.setdefault((int(m[2]), int(m[1])), {})[m[3]] = float(m[4])
    if not rounds:
        raise SystemExit("no round lines in this log")
    variants = list(dict.fromkeys(v for r in rounds.values() for v in r))
    rows = []
    for b in sorted({b for b, _ in rounds}):
        done = [r for (bb, _), r in sorted(rounds.items()) if bb == b and set(r) == set(variants)]  # whole rounds
        rows.append({"batch": b, **{f"{v}_rounds": [r[v] for r in done] for v in variants}})
    shape = re.search(r"(\d+) x (\d+)-token prefill, hidden (\d+), (\d+) layers", label or head)
    a = dict(zip(("prompts", "prompt_len", "hidden", "num_layers"), map(int, shape.groups()))) if shape else \
        dict.fromkeys(("prompts", "prompt_len", "hidden", "num_layers"), "?")
    return {"args": {**a, "variants": variants}, "rows": rows, "device": head.split(":")[0][len("capture overhead on "):]}


def panels_of(path: Path, label: str | None = None) -> list[dict]:
    if path.suffix == ".log":
        return prefill_panels(prefill_from_log(path.read_text(errors="replace"), label))
    d = json.loads(path.read_text())
    if not d.get("rows") and d.get("raw"):  # a serving run stopped early: the raw rounds it wrote after each
        d["rows"] = [{"concurrency": int(c), "rounds": {v: d["raw"][v][c] for v in d["raw"]}}
                     for c in d["raw"]["plain"]]
    if "rows" in d and d["rows"] and "concurrency" in d["rows"][0]:
        return serve_panels(d)
    if "rows" in d and d["rows"] and "batch" in d["rows"][0]:
        return prefill_panels(d)
    raise SystemExit(f"{path}: not a capture_overhead or serve_overhead result (no rows)")


def plot(panels: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, p in zip(axes[0], panels):
        names = list(p["series"])
        seen: list[float] = []
        width = 0.8 / max(1, len(names))
        xs = [x for x, _ in next(iter(p["series"].values()))] if names else []
        for k, v in enumerate(names):
            for i, (_, ratios) in enumerate(p["series"][v]):
                if not ratios:
                    continue
                x = i + (k - (len(names) - 1) / 2) * width
                ax.hlines(statistics.median(ratios), x - width * 0.4, x + width * 0.4, color=f"C{k}", linewidth=3,
                          label=f"{v} (median; dots: rounds)" if i == 0 else None)
                ax.scatter([x] * len(ratios), ratios, color=f"C{k}", s=14, zorder=3, alpha=0.7)
                seen.extend(ratios)
        ax.axhline(p["goal"], color="black", linestyle="--", linewidth=1, label=f"goal {p['goal']}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        lo, hi = min(seen + [p["goal"], 1.0]), max(seen + [p["goal"], 1.0])
        pad = 0.1 * (hi - lo) + 0.01
        ax.set_ylim(lo - pad, hi + pad)  # the spread around 1 is the point, not the distance from 0
        ax.set_xticks(range(len(xs)), xs)
        ax.set_xlabel(p["xlabel"])
        ax.set_ylabel(p["ylabel"])
        ax.set_title(p["title"], fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path, help="capture_overhead / serve_overhead JSON files (or a capture_overhead .log)")
    ap.add_argument("--out", type=Path, default=Path("overhead.png"))
    ap.add_argument("--log-shape", default=None, metavar="TEXT",
                    help="for a log cut short before its summary header: the shape as that header gives it, e.g. "
                         "'256 x 1024-token prefill, hidden 2048, 16 layers'")
    args = ap.parse_args()
    panels = [p for r in args.results for p in panels_of(r, args.log_shape)]
    plot(panels, args.out)
    print(f"wrote {args.out} ({len(panels)} panels)")


if __name__ == "__main__":
    main()
