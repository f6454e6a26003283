"""Training metrics: console lines, TensorBoard scalars, and the end-of-run PNG (loss and accuracy per
draft position). ``acc`` is teacher-forced per position; ``chain`` counts a position only when every
earlier one was right too, which is what speculative decoding actually accepts (SafeAILab/EAGLE#191)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class MetricsLog:
    def __init__(self, out_dir: Path, *, tensorboard: bool = True):
        self.out_dir = out_dir
        self.history: list[dict[str, Any]] = []
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("TensorBoard logging needs `pip install tensorboard` "
                                  "(or pass tensorboard=False / --no-tensorboard)") from e
            self._tb = SummaryWriter(str(out_dir / "tb"))

    def add(self, m: dict[str, Any], *, echo: bool) -> None:
        self.history.append(m)
        step = m["step"]
        if self._tb is not None:
            self._tb.add_scalar("train/loss", m["loss"], step)
            self._tb.add_scalar("train/lr", m["lr"], step)
            self._tb.add_scalar("train/tok_per_s", m["tok_per_s"], step)
            for j, (a, c) in enumerate(zip(m["acc"], m["chain"])):
                self._tb.add_scalar(f"acc/pos{j}", a, step)
                self._tb.add_scalar(f"chain/pos{j}", c, step)
        if echo:
            acc = " ".join(f"{a:.2f}" for a in m["acc"])
            print(f"step {step:5d} loss {m['loss']:.4f} lr {m['lr']:.2e} acc/pos [{acc}] "
                  f"{m['tok_per_s']:.0f} tok/s", flush=True)

    def plot(self, path: Path, title: str = "") -> None:
        if not self.history:
            raise ValueError("MetricsLog.plot: no steps logged")
        import matplotlib

        matplotlib.use("Agg")  # headless: no display on training machines
        import matplotlib.pyplot as plt

        steps = [m["step"] for m in self.history]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        ax1.plot(steps, [m["loss"] for m in self.history])
        ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.set_yscale("log"), ax1.set_title("loss")
        for j in range(len(self.history[0]["acc"])):
            ax2.plot(steps, _smooth([m["acc"][j] for m in self.history]), label=f"pos {j}")
        ax2.set_xlabel("step"), ax2.set_ylabel("accuracy (teacher-forced)"), ax2.set_ylim(0, 1)
        ax2.legend(fontsize=7), ax2.set_title("accuracy per draft position")
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _smooth(xs: list[float], k: int = 5) -> list[float]:
    """Trailing mean over ``k`` steps: per-step accuracies on small batches are noisy."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out
