"""The Tap's proof that a record belongs to its request (``Tap._prove``): sha256 of the record's token ids
against that of the tokens submitted, and against the digest the engine reported for the request where it
reported one (layertap's connector leaves hashing to the record's writer and reports none).
Real records (built as the transports build them); the Tap's state is the few fields the proof reads."""

from types import SimpleNamespace

import pytest
import torch

from layertap.errors import CaptureError
from layertap.records import LAYER_SEMANTICS, Record, token_digest
from layertap.tap import Tap
from layertap.data import InputItem


def _record(ids: list[int], index: int = 3, layers=(1, 2)) -> Record:
    meta = {"index": index, "key": f"run:{index}", "layer_ids": list(layers), "token_digest": token_digest(ids),
            "layer_semantics": LAYER_SEMANTICS, "mode": "prompt"}
    return Record(index=index, token_ids=torch.tensor(ids, dtype=torch.int64),
                  hidden_states=torch.ones(len(ids), len(layers), 8), layer_ids=list(layers),
                  num_prompt_tokens=len(ids), meta=meta)


def _prove(rec: Record, it: InputItem, want: list[int], digest: str | None) -> None:
    tap = SimpleNamespace(layers=[1, 2], check_first=0, _checked=0, _check_engine_tokens=Tap._check_engine_tokens)
    Tap._prove(tap, rec, it, want, digest)


def test_the_record_of_the_submitted_tokens_is_proven():
    ids = [5, 6, 7, 8]
    _prove(_record(ids), InputItem(index=3, token_ids=ids), ids, token_digest(ids))


def test_a_record_with_other_tokens_is_refused_by_name():
    ids = [5, 6, 7, 8]
    with pytest.raises(CaptureError, match="record run:3: token ids differ from input 3"):
        _prove(_record([5, 6, 7, 9]), InputItem(index=3, token_ids=ids), ids, token_digest(ids))


def test_an_engine_digest_of_other_tokens_is_refused_before_the_record_is_trusted():
    ids = [5, 6, 7, 8]
    other = token_digest([5, 6, 7, 9])  # the engine ran other tokens; the record agrees with the engine
    with pytest.raises(CaptureError, match="input 3: the engine's token ids for its request differ"):
        _prove(_record([5, 6, 7, 9]), InputItem(index=3, token_ids=ids), ids, other)


def test_a_record_of_another_index_or_layers_is_refused():
    ids = [5, 6]
    with pytest.raises(CaptureError, match="index 4 != input index 3"):
        _prove(_record(ids, index=4), InputItem(index=3, token_ids=ids), ids, token_digest(ids))
    with pytest.raises(CaptureError, match=r"layer ids \[1, 3\]"):
        _prove(_record(ids, layers=(1, 3)), InputItem(index=3, token_ids=ids), ids, token_digest(ids))


def test_a_checked_record_is_proven_on_the_digest_its_check_computed(monkeypatch):
    """The transports check every record on delivery (its token ids against its manifest's digest); the proof
    reuses that digest instead of hashing the token ids again, and only while they are the ones checked."""
    import layertap.records as records

    ids = [5, 6, 7, 8]
    rec = _record(ids)
    rec.check()
    calls = []
    real = records.token_digest
    monkeypatch.setattr(records, "token_digest", lambda t: calls.append(1) or real(t))
    _prove(rec, InputItem(index=3, token_ids=ids), ids, token_digest(ids))
    assert calls == []  # proven on the checked digest
    rec.token_ids = torch.tensor([5, 6, 7, 9])  # replaced after the check: hashed again, and refused
    with pytest.raises(CaptureError, match="token ids differ from input 3"):
        _prove(rec, InputItem(index=3, token_ids=ids), ids, token_digest(ids))
    assert calls == [1]


def test_without_an_engine_digest_the_record_is_proven_against_the_tokens_submitted():
    ids = [5, 6, 7, 8]
    _prove(_record(ids), InputItem(index=3, token_ids=ids), ids, None)
    with pytest.raises(CaptureError, match="record run:3: token ids differ from input 3"):
        _prove(_record([5, 6, 7, 9]), InputItem(index=3, token_ids=ids), ids, None)


def test_the_tap_queues_successors_in_the_engine_only_where_the_callers_engine_runs_at_most_max_inflight():
    """Tap.lookahead: up to 2 x max_inflight in the engine only where the engine's own max_num_seqs (the
    caller's; the Tap no longer sets it) is at most max_inflight; otherwise max_inflight, or no bound."""
    from layertap.tap import Tap

    tap = Tap.__new__(Tap)
    for seqs, inflight, lookahead, bound in [(1024, 4, True, 4), (4, 4, True, 8), (2, 4, True, 8),
                                             (4, 4, False, 4), (4, None, True, None), (None, 4, True, 4)]:
        tap._engine_seqs, tap.max_inflight, tap.lookahead = seqs, inflight, lookahead
        assert tap._admit_bound() == bound, (seqs, inflight, lookahead)
