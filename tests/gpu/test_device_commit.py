"""The device commit on CUDA (no vLLM needed): a record's rows are copied into its registered shm slot and its
commit word after them, on one copy stream, by the connector's own functions; the consumer (a real
``ShmSource``) must not see the record before its rows landed, and must see it without any engine thread
committing it. Each property has a control that demonstrably breaks without it."""

import pytest
import torch

from layertap.engine.cache_view import slots_for, view_geometry
from layertap.engine.gpu_gather import copy_to_host, gather_on_device, register_host, spans_of, unregister_host
from layertap.transport.base import get_transport

PLANES, HIDDEN, BS, BLOCKS = 4, 512, 16, 64
DELAY = 300_000_000  # GPU cycles the copy stream sleeps before its copies (~0.15 s)
MINE = list(range(0, 32))
N = 32 * BS - 3

SHM = get_transport("shm")


@pytest.fixture
def pool():
    cfg = SHM.prepare({"slot_bytes": 8 << 20, "num_slots": 4, "checksum": "none"})
    src = SHM.make_source(cfg)
    sink = SHM.make_sink(cfg, "gpu-test")
    region = sink.data_region()
    assert register_host(region) is None
    yield sink, src
    torch.cuda.synchronize()
    unregister_host(region)
    sink.close()
    src.close()


def rows_in_cache():
    torch.manual_seed(0)
    view = torch.zeros(BLOCKS, PLANES, BS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    geo = view_geometry(tuple(view.shape), PLANES, HIDDEN, plane_axis=1)
    mine = slots_for(MINE, BS, 0, N)
    want = torch.randn(mine.numel(), PLANES, HIDDEN, device="cuda", dtype=torch.bfloat16)
    view[(mine // BS).cuda(), :, (mine % BS).cuda()] = want
    torch.cuda.synchronize()
    return view, geo, want.cpu()


def reserve(sink, key="req-0"):
    from layertap.records import token_digest

    ids = torch.arange(N)
    specs = {"token_ids": (torch.int64, (N,)), "hidden_states": (torch.bfloat16, (N, PLANES, HIDDEN))}
    meta = {"index": 0, "key": key, "layer_ids": list(range(PLANES)), "num_prompt_tokens": N,
            "token_digest": token_digest(ids)}
    res = sink.reserve(key, specs, meta, device_commit=True)
    res.tensors["token_ids"].copy_(ids)
    return res


def queue(view, geo, res, word, *, commit_first=False, keep_rows=True):
    """The connector's device path (``_copy_and_commit_on_device``), with the copy stream held back by
    ``DELAY`` cycles so a consumer polls while the copies are still queued."""
    side, copy = torch.cuda.Stream(), torch.cuda.Stream()
    rows, gathered, _keep = gather_on_device(view, geo, [MINE], side)
    spans = spans_of([MINE], [N], geo.view_block_size)
    with torch.cuda.stream(copy):
        torch.cuda._sleep(DELAY)
    if commit_first:  # WRONG order: the word before the payload (which then waits another DELAY)
        with torch.cuda.stream(copy):
            res.commit_target.copy_(word, non_blocking=True)
            torch.cuda._sleep(DELAY)
        _, done = copy_to_host(rows, spans, [res.tensors["hidden_states"]], copy, gathered)
    else:
        _, done = copy_to_host(rows, spans, [res.tensors["hidden_states"]], copy, gathered,
                               commits=[res.commit_target], commit_word=word)
    res.handed_to_device()
    if keep_rows:
        rows.record_stream(copy)
    del rows
    return side, done


def test_record_appears_only_after_its_rows_landed_and_nobody_commits_it(pool):
    sink, src = pool
    view, geo, want = rows_in_cache()
    res = reserve(sink)
    word = sink.commit_word().cuda()
    _side, done = queue(view, geo, res, word)
    assert not done.query()  # the copy stream is still asleep
    assert src.poll(0.0) == []
    recs = src.poll(5.0)  # no thread commits it: the word lands after the rows
    assert [r.key for r in recs] == ["req-0"]
    assert torch.equal(recs[0].hidden_states, want)
    recs[0].release()


def test_control_commit_word_before_the_rows_delivers_an_incomplete_record(pool):
    sink, src = pool
    view, geo, want = rows_in_cache()
    res = reserve(sink)
    word = sink.commit_word().cuda()
    _side, done = queue(view, geo, res, word, commit_first=True)
    # The word itself waits behind the sleep too, so wait for it alone: it lands before the payload copy.
    recs = []
    while not recs and not done.query():
        recs = src.poll(0.001)
    assert recs, "the word should have landed before the rows"
    early = recs[0].hidden_states.clone()  # the payload copy is still ~0.15 s away
    assert not done.query()
    assert not torch.equal(early, want)
    recs[0].release()
    done.synchronize()


def adversary_on(side):
    """What the gather stream does next: take the freed gather buffer's size and overwrite it."""
    with torch.cuda.stream(side):  # several: the allocator may hand out another free block of that size first
        ts = [torch.empty(N + 3, PLANES, HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
        for t in ts:
            t.fill_(7.0)
    return ts


@pytest.mark.parametrize("keep_rows", [True, False], ids=["record_stream", "control-without-record_stream"])
def test_gathered_rows_are_not_reused_before_their_copy_ran(pool, keep_rows):
    """With ``record_stream`` the adversary cannot take the gathered buffer before its copy ran; the control
    (without it) shows the buffer reused and the record wrong."""
    sink, src = pool
    view, geo, want = rows_in_cache()
    res = reserve(sink)
    side, done = queue(view, geo, res, sink.commit_word().cuda(), keep_rows=keep_rows)
    _t = adversary_on(side)
    done.synchronize()
    recs = src.poll(1.0)
    assert torch.equal(recs[0].hidden_states, want) == keep_rows
    recs[0].release()
