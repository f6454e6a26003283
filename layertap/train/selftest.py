"""TargetHead self-test on captured records: the head's argmax must reproduce the target's own tokens.

On a span the target generated greedily (capture ``generate`` mode, or regenerated answers), the argmax
of ``lm_head(final_norm(h_N))`` at row t must equal token t+1. This catches a wrong last-layer id (an id
below N, or a post-norm state), a missing final norm, and a head from another checkpoint, before any
training step. Teacher-forced text only gives the target's accuracy, so there it is reported, not enforced.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from layertap.models.head import TargetHead, agreement
from layertap.records import Record
from layertap.train.data import plane_index

MIN_AGREEMENT = 0.95
"""Greedy spans agree exactly up to near-ties, which fp32 HF vs vLLM kernels can flip on a few rows."""


def is_greedy(rec: Record) -> bool:
    return rec.mode == "generate" or bool(rec.meta.get("greedy_answer"))


def head_selftest(target: str | Path, records: Sequence[Record], last_id: int, *, n: int = 8) -> str:
    """Check up to ``n`` records; raises ``ValueError`` with the numbers when greedy spans disagree."""
    head = TargetHead.from_pretrained(target)
    greedy, forced = [], []
    for rec in list(records[i] for i in range(min(n, len(records)))):
        h = rec.hidden_states[:, plane_index(rec, last_id)]
        start = max(_first_trained(rec) - 1, 0)
        if start >= int(rec.token_ids.shape[0]) - 1:
            continue
        (greedy if is_greedy(rec) else forced).append(agreement(head, h, rec.token_ids, start))
    msg = (f"head self-test (layer id {last_id}): greedy-span agreement "
           f"{_mean(greedy)} over {len(greedy)} records; teacher-forced accuracy {_mean(forced)} "
           f"over {len(forced)}")
    if greedy and min(greedy) < MIN_AGREEMENT:
        raise ValueError(f"{msg}: below {MIN_AGREEMENT} on a greedy span - layer id {last_id} is not the "
                         "pre-norm last state of this target, or the head does not belong to it")
    return msg


def _first_trained(rec: Record) -> int:
    """First answer token: from the loss mask when there is one (it survives every transport)."""
    if rec.loss_mask is not None and bool(rec.loss_mask.any()):
        return int(rec.loss_mask.nonzero()[0, 0])
    return rec.num_prompt_tokens


def _mean(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.3f}" if xs else "n/a"
