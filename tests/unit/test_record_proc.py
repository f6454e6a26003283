"""The record process (``layertap.engine.record_proc``) run for real: a child process that takes descriptors from
the engine's side, reserves slots in a real shm pool, copies rows out of the staging ring and commits. Here the
ring is host memory (``staging="host"``), the seam for the device: the same process, protocol and pool code,
with ``memmove`` for the CUDA copies; the CUDA ring, IPC events and copies run on the GPU in
tests/gpu/test_lean_path.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from layertap.engine.record_proc import ALIGN, RecordProcess, RecordProcessError
from layertap.records import LAYER_SEMANTICS, token_digest
from layertap.transport.base import get_transport
from tests.unit.transport_procs import take

SHM = get_transport("shm")
PLANES, HIDDEN = 2, 64
ROW_BYTES = PLANES * HIDDEN * 4  # float32
RUN_META = {"model": "/tmp/m", "config_hash": "0" * 16, "vllm_version": "none", "format_version": 1}
SHARED = {"layer_ids": [1, 2], "layer_semantics": LAYER_SEMANTICS, "cache_group": {"index": 1}}


@pytest.fixture
def pool():
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 32, "checksum": "none"})
    src = SHM.make_source(cfg)
    yield {**cfg, "backend": "shm"}, src
    src.close()
    SHM.cleanup(cfg)


def start(tcfg, ring_bytes=1 << 20, **kw) -> RecordProcess:
    return RecordProcess(transport_cfg=tcfg, run_meta=RUN_META, dtype_name="float32", n_planes=PLANES, hidden=HIDDEN,
                         row_bytes=ROW_BYTES, ring_bytes=ring_bytes, staging="host", start_timeout=60, **kw)


def group(rp: RecordProcess, rng, step: int, counts: list[int], spans=None) -> dict:
    """Rows for one group written into the ring as the gather would, and the descriptor sent; returns the
    expected records by key."""
    nbytes = sum(counts) * ROW_BYTES
    pos = rp.alloc(nbytes)
    off = pos % rp.size
    rows = rng.standard_normal((sum(counts), PLANES, HIDDEN), dtype=np.float32)
    rp.ring_np[off:off + nbytes] = rows.view(np.uint8).reshape(-1)
    items, want, a = [], {}, 0
    for r, n in enumerate(counts):
        key = f"t:{step}-{r}"
        ids = rng.integers(0, 1000, size=n, dtype=np.int64)
        meta = {"key": key, "request_id": f"{step}-{r}", "index": step * 10 + r, "mode": "prompt", "num_tokens": n,
                "num_prompt_tokens": n, "token_digest": token_digest(ids), "run": "t", "loss_spans": spans}
        items.append((key, a, n, ids, meta))
        want[key] = (rows[a:a + n].copy(), ids, meta)
        a += n
    rp.send(pos, nbytes, 0, items, SHARED)
    return want


def check(got: dict, want: dict) -> None:
    for key, (rows, ids, meta) in want.items():
        rec = got[key]
        assert torch.equal(rec.hidden_states, torch.from_numpy(rows)), key
        assert rec.token_ids.tolist() == ids.tolist()
        assert rec.meta["token_digest"] == meta["token_digest"]
        assert rec.meta["layer_ids"] == [1, 2] and rec.meta["model"] == "/tmp/m" and rec.meta["dtype"] == "float32"
        if meta["loss_spans"]:
            mask = np.zeros(len(ids), dtype=np.uint8)
            for a, b in meta["loss_spans"]:
                mask[a:b] = 1
            assert rec.loss_mask.to(torch.uint8).tolist() == mask.tolist()
        rec.release()


def test_records_carry_their_rows_ids_and_manifest(pool):
    tcfg, src = pool
    rp = start(tcfg)
    try:
        rng = np.random.default_rng(0)
        want = {}
        for step in range(4):
            want.update(group(rp, rng, step, [5, 17, 1][: step + 1], spans=[[1, 3]] if step % 2 else None))
        check(take(src, len(want)), want)
        rp.check()
    finally:
        rp.close()
    assert rp.proc.returncode == 0


def test_the_ring_wraps_and_the_step_waits_for_room(pool):
    """A group of one page's rows and one more takes 2 of the ring's 4 pages. With the record process stopped
    (SIGSTOP), two groups fill the ring and the third must wait until it runs again and frees their pages; then
    the ring wraps for nine more groups. (Left to the scheduler, whether the step ever waits depends on which process runs first:
    on a busy machine the record process kept up and this test saw no wait.)"""
    tcfg, src = pool
    rp = start(tcfg, ring_bytes=4 * ALIGN)
    rows = ALIGN // ROW_BYTES + 1
    resume = threading.Timer(0.3, os.kill, (rp.proc.pid, signal.SIGCONT))
    try:
        rng = np.random.default_rng(1)
        want = {}
        os.kill(rp.proc.pid, signal.SIGSTOP)
        try:
            for step in range(2):
                want.update(group(rp, rng, step, [rows]))
            assert rp.waits == 0, "two groups should fit the ring's four pages"
            resume.start()
            t0 = time.monotonic()
            want.update(group(rp, rng, 2, [rows]))  # no room until the stopped process frees the first group's
            assert rp.waits == 1 and time.monotonic() - t0 >= 0.25, "the step did not wait for the ring's room"
        finally:
            resume.cancel()
            os.kill(rp.proc.pid, signal.SIGCONT)
        for step in range(3, 12):  # nothing is taken off the pool meanwhile: 12 records fit its 32 slots
            want.update(group(rp, rng, step, [rows]))
        check(take(src, len(want)), want)
    finally:
        rp.close()


def test_close_commits_everything_handed_over(pool):
    tcfg, src = pool
    rp = start(tcfg)
    rng = np.random.default_rng(2)
    want = {}
    for step in range(6):
        want.update(group(rp, rng, step, [3, 4]))
    rp.close()  # at once: the process drains the pipe before it exits
    assert rp.proc.returncode == 0
    check(take(src, len(want)), want)
    assert not os.path.exists(rp.ctrl_path)


def test_an_error_in_the_process_is_raised_by_name_on_the_next_step(pool):
    tcfg, _ = pool
    rp = start(tcfg)
    try:
        pos = rp.alloc(ROW_BYTES)
        bad = "k" * 4096  # longer than a pool slot's key field
        rp.send(pos, ROW_BYTES, 0, [(bad, 0, 1, np.zeros(1, dtype=np.int64), {"key": bad})], SHARED)
        rp.proc.wait(30)
        with pytest.raises(RecordProcessError, match="shm limit"):
            rp.check()
    finally:
        rp.close(drain=False)


def test_a_dead_process_fails_the_next_handover_by_name(pool):
    tcfg, _ = pool
    rp = start(tcfg)
    try:
        os.kill(rp.proc.pid, signal.SIGKILL)
        rp.proc.wait(30)
        with pytest.raises(RecordProcessError, match="gone"):
            group(rp, np.random.default_rng(3), 0, [2])
    finally:
        rp.close(drain=False)


def test_a_process_that_cannot_start_says_why():
    with pytest.raises(RecordProcessError, match="no-such-backend"):
        start({"backend": "no-such-backend"})


def test_a_set_up_that_fails_after_joining_the_pool_leaves_no_dead_writer_behind(pool, tmp_path):
    """The record process joins the pool as a writer first; a set-up step after that which fails (here the ring's
    file is missing; on the GPU, an IPC handle that does not open) must close that writer, or the consumer
    reports it dead and fails the run (seen on the H100 on 2026-12-06 before the fix)."""
    from layertap.engine.record_proc import CTRL_WORDS, _Writer
    from layertap.transport import shm_pool as sp

    tcfg, src = pool
    ctrl = tmp_path / "ctrl"
    ctrl.write_bytes(bytes(8 * CTRL_WORDS))
    cfg = {"ctrl": str(ctrl), "ring_bytes": 1 << 20, "staging": "host", "ring_path": str(tmp_path / "missing"),
           "transport": tcfg, "run_meta": RUN_META, "dtype": "float32", "n_planes": PLANES, "hidden": HIDDEN,
           "row_bytes": ROW_BYTES}
    with pytest.raises(FileNotFoundError):
        _Writer(cfg)
    names = {i: src.pool.writer(i)[3] for i in range(sp.MAX_WRITERS) if src.pool.writer(i)[0] != sp.W_EMPTY}
    mine = [i for i, name in names.items() if name.endswith(f"-{os.getpid()}-records")]
    assert mine, "the writer never joined the pool: the test did not reach the step under test"
    assert all(src.pool.writer(i)[0] == sp.W_CLOSED for i in mine)  # not left active, to be found dead
    assert src.poll(0.0) == []


def test_the_process_converts_and_hashes_token_ids_the_scheduler_left_as_a_list(pool):
    """The scheduler hands a record's token ids as it has them (a list) and no digest (``SaveJob.token_ids``); the
    record process writes them as int64 and puts their sha256 in the manifest, which the transport checks on
    delivery against the ids."""
    tcfg, src = pool
    rp = start(tcfg)
    try:
        ids = [7, 3, 99999, 0, 5]
        pos = rp.alloc(len(ids) * ROW_BYTES)
        rows = np.random.default_rng(4).standard_normal((len(ids), PLANES, HIDDEN), dtype=np.float32)
        rp.ring_np[pos % rp.size:pos % rp.size + rows.nbytes] = rows.view(np.uint8).reshape(-1)
        meta = {"key": "t:list", "request_id": "list", "index": 0, "mode": "prompt", "num_tokens": len(ids),
                "num_prompt_tokens": len(ids), "run": "t"}
        rp.send(pos, rows.nbytes, 0, [("t:list", 0, len(ids), ids, meta)], SHARED)
        rec = take(src, 1)["t:list"]
        assert rec.token_ids.tolist() == ids and rec.meta["token_digest"] == token_digest(ids)
        assert torch.equal(rec.hidden_states, torch.from_numpy(rows))
        rec.release()
    finally:
        rp.close()


def test_pieces_cover_a_copy_exactly():
    from layertap.engine.record_proc import pieces

    assert pieces(10, 0) == [(0, 10)] and pieces(10, 10) == [(0, 10)] and pieces(0, 4) == [(0, 0)]
    assert pieces(10, 4) == [(0, 4), (4, 4), (8, 2)]
    for n, c in [(1 << 20, 4096), (12345, 1000), (ROW_BYTES * 17, ROW_BYTES * 3)]:
        got = pieces(n, c)
        assert sum(k for _, k in got) == n and all(0 < k <= c for _, k in got)
        assert all(o == sum(k for _, k in got[:i]) for i, (o, _) in enumerate(got))


def test_records_copied_in_pieces_equal_those_copied_whole(pool):
    """Pieces smaller than a row, and not dividing a record: every byte still lands once, in place."""
    tcfg, src = pool
    rp = start(tcfg, copy_chunk=ROW_BYTES // 3)
    try:
        rng = np.random.default_rng(5)
        want = {}
        for step in range(3):
            want.update(group(rp, rng, step, [5, 17, 1][: step + 1]))
        check(take(src, len(want)), want)
    finally:
        rp.close()


def test_the_benchmark_aid_that_skips_rows_still_commits_every_record(pool):
    """rows="skip" (capture-nocopy in benchmarks/capture_overhead.py) leaves a fresh pool's slot bytes as they
    were (zeros) and commits each record with its ids; an unknown mode is refused by name."""
    tcfg, src = pool
    with pytest.raises(ValueError, match="rows='bogus'"):
        start(tcfg, rows="bogus")
    rp = start(tcfg, rows="skip")
    try:
        want = group(rp, np.random.default_rng(6), 0, [4, 9])
        got = take(src, len(want))
        for key, (rows, ids, _) in want.items():
            rec = got[key]
            assert rec.token_ids.tolist() == ids.tolist()
            assert not torch.equal(rec.hidden_states, torch.from_numpy(rows))
            assert not rec.hidden_states.any()
            rec.release()
    finally:
        rp.close()
