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
"""Greedy spans agree exactly up to near-ties (``NEAR_TIE``), which kernels of other precision can flip."""

NEAR_TIE = 2.0 ** -5
"""A greedy span's row also agrees where the engine's token scores within this share of the best logit
(``models.head.agreement``): a few bf16 rounding steps of the engine's weights, norm and logits. A wrong
layer id or a foreign head misses by far more. Without it a bf16 engine's near-ties failed the test on a
tiny target: 3 of a 32-token span (CI, 2026-12-06; agreement 0.968 over 3 records, one of them below 0.95)."""


def is_greedy(rec: Record) -> bool:
    return rec.mode == "generate" or bool(rec.meta.get("greedy_answer"))


class HeadSelfTest:
    """The self-test fed one record at a time, as records arrive (``layertap train`` runs it on the first
    ``n`` records of the stream; each record is measured when it arrives and not kept, so a transport that
    reuses a record's memory after training on it is never read late). ``head`` may live on the trainer's
    device: the check then costs one head pass over each of ``n`` records."""

    def __init__(self, head: TargetHead, last_id: int, *, n: int = 8):
        self.head, self.last_id, self.n = head, last_id, n
        self.greedy: list[float] = []
        self.forced: list[float] = []
        self.seen = 0

    @property
    def done(self) -> bool:
        return self.seen >= self.n

    def add(self, rec: Record) -> None:
        """Measure one record (ignored once ``n`` were seen); raises ``ValueError`` at once when its greedy
        span disagrees, and when it holds no plane of the last layer id."""
        if self.done:
            return
        self.seen += 1
        h = rec.hidden_states[:, plane_index(rec, self.last_id)]
        start = max(_first_trained(rec) - 1, 0)
        if start >= int(rec.token_ids.shape[0]) - 1:
            return
        if not is_greedy(rec):
            self.forced.append(agreement(self.head, h, rec.token_ids, start))
            return
        self.greedy.append(agreement(self.head, h, rec.token_ids, start, near_tie=NEAR_TIE))
        if self.greedy[-1] < MIN_AGREEMENT:
            self.result()  # raises at the first bad record: nothing trains on its labels

    def result(self) -> str:
        """The numbers as one line; raises ``ValueError`` with them when a greedy span disagrees."""
        msg = (f"head self-test (layer id {self.last_id}): greedy-span agreement "
               f"{_mean(self.greedy)} over {len(self.greedy)} records; teacher-forced accuracy "
               f"{_mean(self.forced)} over {len(self.forced)}")
        if self.greedy and min(self.greedy) < MIN_AGREEMENT:
            raise ValueError(f"{msg}: below {MIN_AGREEMENT} on a greedy span (near-ties within {NEAR_TIE:.3f} of "
                             f"the best logit counted as agreeing) - layer id {self.last_id} is not "
                             "the pre-norm last state of this target, or the head does not belong to it")
        return msg


def head_selftest(target: str | Path, records: Sequence[Record], last_id: int, *, n: int = 8) -> str:
    """Check up to ``n`` records; raises ``ValueError`` with the numbers when greedy spans disagree."""
    test = HeadSelfTest(TargetHead.from_pretrained(target), last_id, n=n)
    for i in range(min(n, len(records))):
        test.add(records[i])
    return test.result()


def _first_trained(rec: Record) -> int:
    """First answer token: from the loss mask when there is one (it survives every transport)."""
    if rec.loss_mask is not None and bool(rec.loss_mask.any()):
        return int(rec.loss_mask.nonzero()[0, 0])
    return rec.num_prompt_tokens


def _mean(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.3f}" if xs else "n/a"
