"""The shm transport: real shared memory, real producer/consumer processes, /dev/shm listed around each test."""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from layertap.records import IntegrityError
from layertap.transport import shm_pool as sp
from layertap.transport.base import PeerGone, TransportError, TransportFull, get_transport
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper runs as a script too
from transport_procs import expected_hidden, make_record, read_line, shm_entries, spawn, wait_for  # noqa: E402

SHM = get_transport("shm")


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = shm_entries()
    yield
    wait_for(lambda: shm_entries() <= before, 10, f"/dev/shm to drop {shm_entries() - before}")


@pytest.fixture
def pool():
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 4, "put_timeout": 10, "checksum": "crc32"})
    src = SHM.make_source(cfg)
    yield cfg, src
    src.close()


def drain(src, n: int, timeout: float = 20.0, tokens: int = 16) -> list[str]:
    keys: list[str] = []

    def step() -> bool:
        for rec in src.poll(0.1):
            assert torch.equal(rec.hidden_states, expected_hidden(rec.index, tokens))
            keys.append(rec.key)
            rec.release()
        return len(keys) >= n

    wait_for(step, timeout, f"{n} records")
    return keys


def test_two_producer_processes_exactly_once_through_a_small_pool(pool):
    cfg, src = pool
    procs = [spawn("produce", "shm", json.dumps(cfg), f"w{w}", str(w * 1000), "150", "16") for w in range(2)]
    keys = drain(src, 300)
    assert sorted(keys) == sorted([f"req-{i}" for i in range(150)] + [f"req-{1000 + i}" for i in range(150)])
    for w, p in enumerate(procs):  # per writer, commit order is put order
        mine = [int(k.split("-")[1]) for k in keys if (int(k.split("-")[1]) >= 1000) == (w == 1)]
        assert mine == sorted(mine)
        assert read_line(p) == "ready" and json.loads(read_line(p))["done"] == 150
        assert p.wait(10) == 0
    assert src.poll(0.05) == []


def test_slow_consumer_fast_producer_stays_in_pool_and_producer_waits(pool):
    """Guarantee 3: 1200 records through 4 slots; the pool never grows; the producer is slowed."""
    cfg, src = pool
    seg = os.path.join("/dev/shm", cfg["name"])
    prod = spawn("produce", "shm", json.dumps(cfg), "fast", "0", "1200", "16")
    keys, outstanding_max = [], 0
    while len(keys) < 1200:
        batch = src.poll(5.0)
        if not batch:
            raise TimeoutError(f"stalled after {len(keys)} records: {prod.stderr.read() if prod.poll() else ''}")
        outstanding_max = max(outstanding_max, cfg["num_slots"] - src.free_capacity())
        for rec in batch:
            keys.append(rec.key)
            rec.release()
        time.sleep(0.002)  # the slow consumer
        st = os.stat(seg)
        assert st.st_size == cfg["pool_bytes"] and st.st_blocks * 512 <= cfg["pool_bytes"]
    assert keys == [f"req-{i}" for i in range(1200)]
    assert outstanding_max <= cfg["num_slots"]
    assert read_line(prod) == "ready"
    summary = json.loads(read_line(prod))
    assert summary["done"] == 1200 and summary["waits"] > 100, summary  # backpressure, not drops
    assert prod.wait(10) == 0


def test_full_pool_raises_transport_full_naming_the_record(pool):
    cfg, src = pool
    sink = SHM.make_sink({**cfg, "put_timeout": 0.2}, "w")
    for i in range(cfg["num_slots"]):
        sink.put(*make_record(i))
    t0 = time.monotonic()
    with pytest.raises(TransportFull, match="req-99"):
        sink.put(*make_record(99))
    assert time.monotonic() - t0 < 2
    assert len(src.poll(0)) == cfg["num_slots"]
    sink.close()


def test_record_larger_than_a_slot_spans_slots_and_oversize_fails(pool):
    cfg, src = pool
    sink = SHM.make_sink(cfg, "w")
    sink.put(*make_record(1, tokens=2500, layers=2, hidden=8))  # 180 KB: 3 slots of 64 KiB
    assert src.free_capacity() == 1
    [rec] = src.poll(1)
    assert torch.equal(rec.hidden_states, expected_hidden(1, 2500))
    rec.release()
    with pytest.raises(TransportError, match="req-2"):
        sink.put(*make_record(2, tokens=5000, layers=2, hidden=8))
    sink.close()


def test_corrupt_payload_raises_naming_record_and_others_still_arrive(pool):
    cfg, src = pool
    sink = SHM.make_sink(cfg, "w")
    sink.put(*make_record(0))
    sink.put(*make_record(1))
    p = sp.Pool(cfg["name"])
    head = next(i for i in range(p.num_slots) if p.slot(i).key == "req-0")
    p.mm[p.data_off + head * p.slot_bytes + p.slot(head).length - 1] ^= 0xFF
    with pytest.raises(IntegrityError, match="req-0"):
        src.poll(1)
    [rec] = src.poll(1)
    assert rec.key == "req-1"
    rec.release()
    p.close()
    sink.close()


def test_token_digest_mismatch_and_duplicate_key_raise_naming_record(pool):
    cfg, src = pool
    sink = SHM.make_sink(cfg, "w")
    key, tensors, meta = make_record(5)
    sink.put(key, tensors, {**meta, "token_digest": "0" * 64})
    with pytest.raises(IntegrityError, match="req-5"):
        src.poll(1)
    sink.put(*make_record(6))
    src.poll(1)[0].release()
    sink.put(*make_record(6))
    with pytest.raises(TransportError, match="req-6.*twice"):
        src.poll(1)
    sink.close()


def test_copy_mode_frees_the_slot_at_once():
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 4})
    src = SHM.make_source(cfg, copy=True)
    sink = SHM.make_sink(cfg, "w")
    for i in range(6):  # more than the 4 slots: only possible because copies free them
        sink.put(*make_record(i))
        [rec] = src.poll(1)
        assert src.free_capacity() == cfg["num_slots"] and torch.equal(rec.hidden_states, expected_hidden(i))
    sink.close()
    src.close()


def test_closed_consumer_makes_put_raise_peer_gone():
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 2})
    src = SHM.make_source(cfg)
    sink = SHM.make_sink(cfg, "w")
    src.close()
    with pytest.raises(PeerGone, match="req-0"):
        sink.put(*make_record(0))
    sink.close()


def test_kill_consumer_then_producer_fails_fast_no_leak_and_a_new_consumer_resumes():
    cons = spawn("consume", "shm", json.dumps({"slot_bytes": 64 << 10, "num_slots": 4}))
    cfg = json.loads(read_line(cons))
    sink = SHM.make_sink(cfg, "vllm")
    sink.put(*make_record(0))
    assert read_line(cons) == "req-0"
    os.kill(cons.pid, signal.SIGKILL)
    cons.wait(10)
    t0 = time.monotonic()
    with pytest.raises(PeerGone, match=f"pid {cons.pid}.*req-1"):
        sink.put(*make_record(1))
    assert time.monotonic() - t0 < 2
    sink.close()
    wait_for(lambda: cfg["name"] not in shm_entries(), 10, f"{cfg['name']} to be unlinked")
    # Resume: a restarted consumer gets a fresh pool and the (restarted) producer continues from req-1.
    cons2 = spawn("consume", "shm", json.dumps({"slot_bytes": 64 << 10, "num_slots": 4}))
    cfg2 = json.loads(read_line(cons2))
    sink2 = SHM.make_sink(cfg2, "vllm")
    sink2.put(*make_record(1))
    assert read_line(cons2) == "req-1"
    sink2.close()
    cons2.terminate()
    cons2.wait(10)
    wait_for(lambda: cfg2["name"] not in shm_entries(), 10, f"{cfg2['name']} to be unlinked")


def test_kill_producer_mid_stream_consumer_gets_named_error_within_seconds(pool):
    cfg, src = pool
    prod = spawn("produce", "shm", json.dumps(cfg), "vllm-worker-0", "0", "-1", "64")
    assert read_line(prod) == "ready"
    drain(src, 20, tokens=64)  # records are flowing
    os.kill(prod.pid, signal.SIGKILL)
    prod.wait(10)
    t0 = time.monotonic()
    got = 0

    def dies() -> bool:
        nonlocal got
        try:
            for rec in src.poll(0.1):  # whatever was committed before the kill is still delivered
                got += 1
                rec.release()
        except PeerGone as e:
            assert "vllm-worker-0" in str(e) and str(prod.pid) in str(e)
            return True
        return False

    wait_for(dies, 5, "PeerGone from the consumer")
    assert time.monotonic() - t0 < 5
    assert src.free_capacity() == cfg["num_slots"]  # half-written slots were reclaimed


def test_reserved_records_are_filled_in_place_and_invisible_until_committed(pool):
    """The zero-staging path (a GPU copy lands straight in the slot): header first, data in place, then
    commit; an uncommitted or aborted reservation is never delivered, and a full pool returns None at
    once instead of waiting."""
    cfg, src = pool
    sink = SHM.make_sink(cfg, "reserver")
    try:
        reservations = []
        for i in range(4):
            key, tensors, meta = make_record(i)
            res = sink.reserve(key, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, meta)
            assert res is not None
            for k, t in tensors.items():
                res.tensors[k].copy_(t)
            reservations.append(res)
        assert sink.reserve("one-too-many", {"token_ids": (torch.int64, (4,))}, {}) is None
        assert src.poll(0.05) == []  # nothing committed yet
        reservations[1].abort()
        reservations[3].commit()
        reservations[0].commit()
        with pytest.raises(TransportError, match="already committed"):
            reservations[0].commit()
        recs = src.poll(0.5)
        assert [r.key for r in recs] == ["req-3", "req-0"]  # commit order
        for r in recs:
            assert torch.equal(r.hidden_states, expected_hidden(r.index))
            r.release()
        assert src.free_capacity() == 3  # the aborted slot came back; one is still reserved
        reservations[2].abort()
        assert src.free_capacity() == 4
    finally:
        sink.close()


def _tell(proc, line: str) -> None:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


@pytest.mark.parametrize("how", ["views", "raw"])
def test_device_commit_is_invisible_until_its_word_lands_then_delivered_without_a_ring(how):
    """The CUDA path's commit (shm_pool docstring): the writer process takes the sequence number when it
    reserves and never commits on the CPU; the record appears when its slot's state word lands, in any
    order, and the consumer notices without a doorbell ring. The one ring comes when the batch is handed to
    the device (``wake_consumer``): a consumer already waiting when the records were claimed saw nothing
    pending and would sleep its longest wait after they landed (up to 50 ms at the end of every
    ``Tap.capture`` call on CUDA). ``raw``: the reservation is byte offsets into the mapping (the lean record
    path's ``views=False``), every byte written through them. A checksum pool refuses device commits."""
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 4, "checksum": "none"})
    src = SHM.make_source(cfg)
    assert src.poll(0.0) == []  # looked once: nothing pending to watch
    prod = spawn("device-reserve", "shm", json.dumps(cfg), "cuda-worker", "3", how)
    try:
        assert read_line(prod) == "reserved"
        assert select.select([src.bell.sock], [], [], 10.0)[0], "handing records to the device rang no bell"
        assert src.poll(0.2) == []  # reserved, payload written, but no word landed: nothing to deliver
        assert src.free_capacity() == 1
        _tell(prod, "land 2")
        assert read_line(prod) == "landed"
        t0 = time.monotonic()
        recs = src.poll(2.0)  # no ring comes: the consumer watches the pending state words
        assert time.monotonic() - t0 < 0.5
        assert [r.key for r in recs] == ["req-2"]
        assert torch.equal(recs[0].hidden_states, expected_hidden(2))
        recs[0].release()
        assert src.poll(0.05) == []
        for i in (0, 1):
            _tell(prod, f"land {i}")
            assert read_line(prod) == "landed"
        keys = []
        wait_for(lambda: keys.extend(r.key for r in src.poll(0.1) if r.release() is None) or len(keys) == 2, 5,
                 "two records")
        assert sorted(keys) == ["req-0", "req-1"]
        _tell(prod, "exit")
        assert prod.wait(10) == 0
        assert src.free_capacity() == 4
    finally:
        prod.kill()
        src.close()
    crc = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 2, "checksum": "crc32"})
    src = SHM.make_source(crc)
    sink = SHM.make_sink(crc, "w")
    try:
        assert not sink.device_commit_ok
        with pytest.raises(TransportError, match="device commit needs checksum 'none'"):
            sink.reserve("k", {"token_ids": (torch.int64, (4,))}, {}, device_commit=True)
    finally:
        sink.close()
        src.close()


def test_writer_killed_with_device_commits_pending_is_named_and_its_slots_reclaimed():
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 4, "checksum": "none"})
    src = SHM.make_source(cfg)
    prod = spawn("device-reserve", "shm", json.dumps(cfg), "cuda-worker-1", "2")
    try:
        assert read_line(prod) == "reserved"
        _tell(prod, "land 0")
        assert read_line(prod) == "landed"
        os.kill(prod.pid, signal.SIGKILL)
        prod.wait(10)
        got = []

        def dies() -> bool:
            try:
                got.extend(r.key for r in src.poll(0.1) if r.release() is None)
            except PeerGone as e:
                assert "cuda-worker-1" in str(e) and "req-1" in str(e) and "req-0" not in str(e)
                return True
            return False

        wait_for(dies, 5, "PeerGone naming the record lost in flight")
        assert got == ["req-0"]  # the landed one is delivered first
        assert src.free_capacity() == 4
    finally:
        src.close()


def test_a_stopped_lock_holder_is_a_named_error_not_a_hang():
    """Every holder keeps the pool lock for microseconds; one stopped while holding it (SIGSTOP, a debugger)
    must not hang its peers: they give up after ``LOCK_TIMEOUT`` naming the pid, and go on once it is gone."""
    import subprocess

    cfg = SHM.prepare({"slot_bytes": 4096, "num_slots": 2})
    src = SHM.make_source(cfg)
    code = ("import os, signal; from layertap.transport import shm_pool as sp; p = sp.Pool(%r)\n"
            "with p.locked():\n    print('locked', flush=True); os.kill(os.getpid(), signal.SIGSTOP)\n" % cfg["name"])
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pool = sp.Pool(cfg["name"])
    try:
        assert holder.stdout.readline().strip() == "locked"
        pool.LOCK_TIMEOUT = 1.0
        t0 = time.monotonic()
        with pytest.raises(TransportError, match=f"held by another process for 1 s \\(pid {holder.pid}"):
            pool.claim(1, 0, b"k")
        assert 0.9 < time.monotonic() - t0 < 5
        st = pool.lock_stats()  # the wait is counted where the engine's worker logs it
        assert st["acquired"] == st["contended"] == 1 and 900 < st["longest_wait_ms"] == st["waited_ms"] < 5000
        holder.kill()
        holder.wait(10)
        assert pool.claim(1, 0, b"k") == 0  # the kernel dropped the dead holder's lock
        st = pool.lock_stats()
        assert st["acquired"] == 2 and st["contended"] == 1  # a free lock is not a contended one
    finally:
        holder.kill()
        holder.wait(10)
        pool.close()
        src.close()


def test_vectorized_table_reads_match_word_by_word_reads():
    """``state_words`` / ``free_slots`` / ``active_writers`` read the tables in strided numpy copies (the
    Tap asks for the free count before every admission); they must agree with reading each entry."""
    cfg = SHM.prepare({"slot_bytes": 64 << 10, "num_slots": 37, "checksum": "none"})
    src = SHM.make_source(cfg)
    try:
        sinks = [SHM.make_sink(cfg, f"w{i}") for i in range(3)]
        p = src.pool
        heads = [p.claim(span, sinks[0].writer, b"k%d" % span) for span in (1, 3, 2)]
        p.commit(heads[1], 10, 0)
        sinks[1].close()
        words = [p.slot(i).state for i in range(p.num_slots)]
        assert p.state_words().tolist() == words and len(set(words)) >= 3  # FREE, WRITING, CONT, COMMITTED present
        assert p.free_slots() == words.count(sp.FREE) == 37 - 6
        want = [w for w in range(sp.MAX_WRITERS) if p.writer(w)[0] == sp.W_ACTIVE]
        assert p.active_writers() == want and len(want) == 2
        for s in (sinks[0], sinks[2]):
            s.close()
    finally:
        src.close()
