"""Fit an uncertainty probe on the hidden states of what the model generated (the lm-polygraph use).

Task (correctness is decidable): the trained tiny target (``layertap.models.train_target``, a Qwen3 trained
on Python standard-library code in "continue this code" chat turns) is shown held-out code and asked to
continue it. That target is small and weakly trained (it rarely gets a whole line right), so the answer
is short: a sample is *correct* when its first generated token equals the file's true next token.

For every prompt ``Tap.generate`` draws ``n`` samples; each sample comes back with its hidden states from
the very pass that generated it (no second forward pass). Features per sample: the post-norm last-layer
state and a middle layer's state, averaged over the first ``--rows`` generated rows (row ``P - 1 + k``
produced token ``k``; rows after the first have seen the sampled answer). A logistic-regression probe on
those features is fit on 70% of the prompts and scored on the rest (split by prompt), and compared with
the classic baseline, the answer token's log-probability (from vLLM's logprobs).

    python examples/uncertainty_probe.py                       # ~2-4 min on 2 CPU cores
    python examples/uncertainty_probe.py --prompts 120 --out /tmp/probe.png

Writes a PNG (ROC curves of probe and baseline on the held-out prompts) and prints AUROCs.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Sample:
    prompt: int
    features: torch.Tensor
    mean_logprob: float
    correct: bool


def task(n: int, seed: int, tokenizer) -> tuple[list[dict], list[list[int]]]:
    """``n`` held-out prompts (token ids, chat-rendered) and the token ids of each one's true continuation
    (prompts whose next line is blank are skipped: a newline is a trivial answer)."""
    from layertap.models.train_target import chat_conversations

    prompts, answers = [], []
    for conv in chat_conversations(2 * n, seed):
        if len(prompts) == n:
            break
        if not conv[1]["content"].split("\n")[0].strip():
            continue  # a blank next line is a trivial answer; keep lines with content
        ids = tokenizer.apply_chat_template(conv[:1], tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        prompts.append({"prompt_token_ids": list(ids)})
        answers.append(tokenizer.encode(conv[1]["content"], add_special_tokens=False))
    return prompts, answers


def samples_from(outs, answers: list[list[int]], n_rows: int) -> list[Sample]:
    res = []
    for i, out in enumerate(outs):
        p = len(out.prompt_token_ids)
        for comp in out.outputs:
            # hidden_states: [P + G - 1, len(layers), hidden]; the last layer's plane is post-norm.
            rows = list(range(p - 1, min(p - 1 + n_rows, comp.hidden_states.shape[0])))
            feats = comp.hidden_states[rows].float().mean(0).flatten()
            answer = comp.token_ids[0]
            res.append(Sample(i, feats, comp.logprobs[0][answer].logprob, answer == answers[i][0]))
    return res


def fit_probe(x: torch.Tensor, y: torch.Tensor, l2: float = 1e-1, steps: int = 300) -> torch.nn.Linear:
    """L2-regularized logistic regression (LBFGS on standardized features)."""
    probe = torch.nn.Linear(x.shape[1], 1)
    opt = torch.optim.LBFGS(probe.parameters(), max_iter=steps, line_search_fn="strong_wolfe")
    pos = y.mean().clamp(1e-3, 1 - 1e-3)
    weight = torch.where(y > 0, 0.5 / pos, 0.5 / (1 - pos))  # balance the classes

    def closure():
        opt.zero_grad()
        logits = probe(x).squeeze(1)
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none") * weight).mean()
        loss = loss + l2 * probe.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return probe


def roc(score: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """ROC curve (fpr, tpr) and AUROC (probability a correct sample outscores an incorrect one)."""
    order = torch.argsort(score, descending=True)
    ys = y[order]
    tpr = torch.cat([torch.zeros(1), ys.cumsum(0) / ys.sum()])
    fpr = torch.cat([torch.zeros(1), (1 - ys).cumsum(0) / (1 - ys).sum()])
    auc = float(torch.trapezoid(tpr, fpr))
    return fpr, tpr, auc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=240, help="held-out prompts (default 240)")
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt, SamplingParams.n (default 4)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rows", type=int, default=4, help="generated rows averaged into the features (default 4)")
    ap.add_argument("--seed", type=int, default=1234, help="prompt seed; the target trained on seed 0")
    ap.add_argument("--out", default="uncertainty_probe.png", help="PNG to write")
    args = ap.parse_args()

    from vllm import SamplingParams

    from layertap.models.train_target import trained_target
    from layertap.tap import Tap

    torch.manual_seed(0)
    model = trained_target()
    layers = [2, 4]  # 4 = the last layer; post_norm_last applies the model's final RMSNorm to it
    with Tap(model=model, layers=layers, post_norm_last=True, dtype="float32", max_model_len=1024,
             kv_cache_memory_bytes=256 << 20, enable_prefix_caching=True) as tap:
        tok = tap.tokenizer
        prompts, answers = task(args.prompts, args.seed, tok)
        sp = SamplingParams(n=args.samples, temperature=args.temperature, max_tokens=args.rows, logprobs=1,
                            stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")])
        t0 = time.monotonic()
        outs = tap.generate(prompts, sp)
        print(f"generated {args.prompts} x {args.samples} samples with hidden states in {time.monotonic() - t0:.1f}s")
        samples = samples_from(outs, answers, args.rows)

    y = torch.tensor([s.correct for s in samples], dtype=torch.float32)
    print(f"{int(y.sum())} of {len(samples)} samples correct ({100 * float(y.mean()):.1f}%)")
    if y.sum() < 5 or (1 - y).sum() < 5:
        raise SystemExit("too few correct or incorrect samples to fit a probe; raise --prompts")
    train = torch.tensor([s.prompt < 0.7 * args.prompts for s in samples])
    x = torch.stack([s.features for s in samples])
    mu, sd = x[train].mean(0), x[train].std(0) + 1e-6
    x = (x - mu) / sd
    probe = fit_probe(x[train], y[train])
    with torch.no_grad():
        probe_score = probe(x[~train]).squeeze(1)
    base_score = torch.tensor([s.mean_logprob for s in samples])[~train]
    curves = {"hidden-state probe": roc(probe_score, y[~train]), "answer logprob": roc(base_score, y[~train])}
    for name, (_, _, auc) in curves.items():
        print(f"held-out AUROC, {name}: {auc:.3f}")
    plot(curves, int((~train).sum()), Path(args.out))
    print(f"wrote {args.out}")


def plot(curves: dict, n_test: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    for name, (fpr, tpr, auc) in curves.items():
        ax.plot(fpr, tpr, label=f"{name} (AUROC {auc:.3f})")
    ax.plot([0, 1], [0, 1], ":", color="gray")
    ax.set_xlabel("false positive rate (incorrect samples trusted)")
    ax.set_ylabel("true positive rate (correct samples trusted)")
    ax.set_title(f"Is the next token right? {n_test} held-out samples")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
