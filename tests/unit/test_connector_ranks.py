"""Tensor-parallel rank selection in the connector's worker side, on the CPU: only TP rank 0 opens the
transport, starts the writer and writes records; every other rank gathers nothing and reports nothing, and
the scheduler side waits for one report per save (``get_finished_count``). The real vLLM engine runs the same
code at TP=1 in the engine tests; TP=2 runs on two GPUs (scripts/gpu_check.sh tests)."""

from types import SimpleNamespace as NS

import pytest
import torch

from layertap.engine import compat, connector
from layertap.engine.record_writer import WorkerSide
from layertap.engine.saves import LayertapMetadata, SaveJob
from layertap.records import LAYER_SEMANTICS, token_digest
from layertap.transport.base import get_transport

SHM = get_transport("shm")
HIDDEN, PLANES, BS, BLOCKS = 16, 2, 4, 8


@pytest.fixture
def pool():
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 4})
    src = SHM.make_source(cfg)
    yield {**cfg, "backend": "shm"}, src
    src.close()


def worker(monkeypatch, rank: int, tcfg: dict) -> WorkerSide:
    monkeypatch.setattr(compat, "tp_rank", lambda: rank)
    monkeypatch.setattr(compat, "hidden_size", lambda cfg: HIDDEN)
    monkeypatch.setattr(compat, "num_layers", lambda cfg: 4)
    c = NS(_extra={"transport": tcfg, "run_meta": {}}, _layer_ids=[1, 2], _block_size=BS, _group=0,
           _group_desc={})
    w = WorkerSide(c, vllm_config=None)
    view = torch.arange(BLOCKS * PLANES * BS * HIDDEN, dtype=torch.float32).reshape(BLOCKS, PLANES, BS, HIDDEN)
    w.register({"model.layers.0.attn": torch.zeros(1), f"{compat.CAPTURE_LAYER_MARK}.4": view})
    return w


def save(rid: str, n: int) -> SaveJob:
    ids = list(range(n))
    meta = {"key": f"r:{rid}", "request_id": rid, "index": 0, "mode": "prompt", "layer_ids": [1, 2], "num_tokens": n,
            "num_prompt_tokens": n, "token_digest": token_digest(ids), "layer_semantics": LAYER_SEMANTICS,
            "next_token_id": None, "cache_group": {}, "run": "r"}
    return SaveJob(rid, f"r:{rid}", [1, 2], ids, n, meta, release=False)


def test_only_rank0_writes_and_reports(monkeypatch, pool):
    tcfg, src = pool
    w1 = worker(monkeypatch, 1, tcfg)
    assert not w1.rank0 and w1.sink is None and w1.writer is None
    assert w1.finished(LayertapMetadata(saves=[save("a", 6)])) is None  # gathers nothing, reports nothing
    w0 = worker(monkeypatch, 0, tcfg)
    assert w0.rank0 and w0.sink is not None
    assert w0.finished(LayertapMetadata(saves=[save("a", 6)])) is None  # an early prompt save releases nothing
    job = save("b", 7)
    job.release = True
    assert w0.finished(LayertapMetadata(saves=[job])) == {"b"}
    recs = []
    for _ in range(50):
        recs += src.poll(0.1)
        if len(recs) == 2:
            break
    assert sorted(r.key for r in recs) == ["r:a", "r:b"]
    b = next(r for r in recs if r.key == "r:b")
    # rows 0..6 of blocks [1, 2] (block size 4): block 1's 4 rows, then 3 of block 2, both planes
    want = torch.cat([w0.view[1], w0.view[2]], dim=1)[:, :7].permute(1, 0, 2)
    assert torch.equal(b.hidden_states, want)
    for r in recs:
        r.release()
    w0.close()
    w1.close()
    assert connector.LayertapConnector.get_finished_count(None) == 1  # the scheduler counts rank 0 only
