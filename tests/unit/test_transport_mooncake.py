"""The mooncake transport against a real ``mooncake_master`` on 127.0.0.1 (P2PHANDSHAKE metadata).

Skipped only when the Mooncake extra is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("mooncake.store", reason="needs the mooncake extra (mooncake-transfer-engine-non-cuda)")

from layertap.records import IncompleteRecordError, IntegrityError  # noqa: E402
from layertap.transport.base import PeerGone, TransportFull, get_transport  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper runs as a script too
from transport_procs import expected_hidden, make_record, read_line, shm_entries, spawn, wait_for  # noqa: E402

from tests.netutil import mooncake_master  # noqa: E402

MC = get_transport("mooncake")


@pytest.fixture
def master():
    """A real master bound to loopback; yields (address, process, ports); killed at the end."""
    before = shm_entries("mooncake") | shm_entries("layertap-")
    with mooncake_master() as started:
        yield started
    after = shm_entries("mooncake") | shm_entries("layertap-")  # another run's segments are not counted
    assert after <= before, f"leaked /dev/shm entries: {after - before}"


def config(addr: str, **kw) -> dict:
    return MC.prepare({"master": addr, "segment_bytes": 32 << 20, "buffer_bytes": 8 << 20, "heartbeat_s": 0.3,
                       "peer_timeout": 2.0, **kw})


def collect(src, n: int, timeout: float = 20.0, **shape: int) -> list[str]:
    keys: list[str] = []

    def step() -> bool:
        for rec in src.poll(0.1):
            assert torch.equal(rec.hidden_states, expected_hidden(rec.index, **shape))
            keys.append(rec.key)
        return len(keys) >= n

    wait_for(step, timeout, f"{n} records")
    return keys


def test_producer_process_to_consumer_exactly_once(master):
    addr, _, _ = master
    cfg = config(addr)
    src = MC.make_source(cfg)
    prod = spawn("produce", "mooncake", json.dumps(cfg), "vllm-0", "0", "30", "16")
    keys = collect(src, 30)
    assert keys == [f"req-{i}" for i in range(30)]
    assert prod.wait(30) == 0
    assert src.poll(0.3) == []
    src.close()


def test_full_store_is_backpressure_then_named_error(master):
    addr, _, _ = master
    cfg = config(addr, put_timeout=1.0)
    src = MC.make_source(cfg)
    sink = MC.make_sink(cfg, "w")
    big = dict(tokens=8192, layers=4, hidden=8)  # ~1 MiB records into a 32 MiB segment
    with pytest.raises(TransportFull, match="req-"):
        for i in range(64):
            sink.put(*make_record(i, **big))
    committed = sink.seq
    assert 10 < committed < 40
    keys = collect(src, committed, **big)  # the consumer drains: room again
    sink.put(*make_record(1000, **big))
    assert collect(src, 1, **big) == ["req-1000"] and len(keys) == committed
    sink.close()
    src.close()


def test_missing_payload_and_bad_checksum_raise_naming_record(master):
    addr, _, _ = master
    cfg = config(addr)
    src = MC.make_source(cfg)
    sink = MC.make_sink(cfg, "w")
    sink.put(*make_record(1))
    assert sink.store.remove(f"{sink.ns}/w0/0/d", True) == 0  # the payload vanished (e.g. evicted)
    with pytest.raises(IncompleteRecordError, match="req-1"):
        src.poll(2)
    sink.put(*make_record(2))
    man = json.loads(sink.store.get(f"{sink.ns}/w0/1/m"))
    sink.store.remove(f"{sink.ns}/w0/1/m", True)
    sink.store.put(f"{sink.ns}/w0/1/m", json.dumps({**man, "crc32": "00000000"}).encode(), sink.rep)
    with pytest.raises(IntegrityError, match="req-2"):
        src.poll(2)
    sink.close()
    src.close()


def test_kill_master_both_sides_get_named_errors_within_seconds(master):
    addr, proc, _ = master
    cfg = config(addr)
    src = MC.make_source(cfg)
    sink = MC.make_sink(cfg, "w")
    sink.put(*make_record(0))
    assert collect(src, 1) == ["req-0"]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    with pytest.raises(PeerGone, match="req-1"):
        sink.put(*make_record(1))
    with pytest.raises(PeerGone):
        src.poll(10)
    assert time.monotonic() - t0 < 15


def test_kill_producer_consumer_names_the_writer(master):
    addr, _, _ = master
    cfg = config(addr)
    src = MC.make_source(cfg)
    prod = spawn("produce", "mooncake", json.dumps(cfg), "vllm-worker-3", "0", "-1", "16")
    assert read_line(prod) == "ready"
    collect(src, 5)
    os.kill(prod.pid, signal.SIGKILL)
    prod.wait(10)
    t0 = time.monotonic()

    def dies() -> bool:
        try:
            src.poll(0.2)  # records committed before the kill still arrive
        except PeerGone as e:
            assert "vllm-worker-3" in str(e)
            return True
        return False

    wait_for(dies, 15, "PeerGone naming the writer")
    assert time.monotonic() - t0 < 15
    src.close()


def test_master_listens_on_loopback_only(master):
    _, proc, ports = master
    listen = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, port = local.rsplit(":", 1)
                if state == "0A" and int(port, 16) in ports:
                    listen.add(addr)
    assert listen == {"0100007F"}, listen  # 127.0.0.1 only
