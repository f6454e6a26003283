"""The file transport: commit protocol under crashes, torn index lines, and a full disk."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layertap.transport.base import TransportError, get_transport
from layertap.transport.file import DiskFullError, FileDataset, load_records
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper runs as a script too
from transport_procs import HERE, expected_hidden, make_record, read_line, spawn, wait_for  # noqa: E402

FILE = get_transport("file")


def test_producer_process_to_tailing_source_exactly_once(tmp_path):
    cfg = FILE.prepare({"path": str(tmp_path / "ds"), "fsync": False})
    src = FILE.make_source(cfg)
    procs = [spawn("produce", "file", json.dumps(cfg), f"w{w}", str(w * 100), "40", "16") for w in range(2)]
    keys: list[str] = []

    def step() -> bool:
        for rec in src.poll(0.1):
            assert torch.equal(rec.hidden_states, expected_hidden(rec.index))
            keys.append(rec.key)
        return len(keys) >= 80

    wait_for(step, 30, "80 records")
    assert sorted(keys) == sorted([f"req-{i}" for i in range(40)] + [f"req-{100 + i}" for i in range(40)])
    assert all(p.wait(10) == 0 for p in procs)
    assert src.poll(0.05) == []
    src.close()
    assert len(load_records(cfg["path"])) == 80


def test_torn_index_line_is_ignored(tmp_path):
    sink = FILE.make_sink({"path": str(tmp_path)}, "w")
    sink.put(*make_record(0))
    sink.close()
    with open(tmp_path / "index-w.jsonl", "ab") as f:
        f.write(b'{"key":"req-1","index":1,"sha')  # a crash mid-line: no newline
    ds = FileDataset(tmp_path)
    assert [r.key for r in ds] == ["req-0"]


def test_record_committed_after_a_torn_line_is_readable(tmp_path):
    with open(tmp_path / "index-w.jsonl", "ab") as f:
        f.write(b'{"key":"req-9","ind')
    sink = FILE.make_sink({"path": str(tmp_path)}, "w")
    sink.put(*make_record(1))
    sink.close()
    assert [r.key for r in FileDataset(tmp_path)] == ["req-1"]


def test_kill_writer_mid_stream_leaves_only_whole_records(tmp_path):
    cfg = {"path": str(tmp_path), "fsync": False}
    prod = spawn("produce", "file", json.dumps(cfg), "w", "0", "-1", "4000")  # ~128 KB records, forever
    assert read_line(prod) == "ready"
    wait_for(lambda: (tmp_path / "index-w.jsonl").exists() and (tmp_path / "index-w.jsonl").stat().st_size > 2000,
             20, "some committed records")
    os.kill(prod.pid, signal.SIGKILL)
    prod.wait(10)
    ds = FileDataset(tmp_path)
    assert len(ds) > 5
    for rec in ds:  # every indexed record is whole and checks (crc + digest)
        assert torch.equal(rec.hidden_states, expected_hidden(rec.index, 4000))


def test_disk_full_names_the_record_and_leaves_no_partial_bytes(tmp_path, monkeypatch):
    sink = FILE.make_sink({"path": str(tmp_path), "fsync": True}, "w")
    sink.put(*make_record(0))
    real = os.fdatasync

    def full(fd: int) -> None:  # the seam: the file system reports ENOSPC when flushing the payload
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fdatasync", full)
    with pytest.raises(DiskFullError, match="req-1"):
        sink.put(*make_record(1))
    monkeypatch.setattr(os, "fdatasync", real)
    sink.put(*make_record(2))  # space is back: the next record lands right after the last good one
    sink.close()
    assert [r.key for r in FileDataset(tmp_path)] == ["req-0", "req-2"]


def test_file_size_limit_in_a_real_process_names_the_record(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse the write (EFBIG): a real failed write, not a mock."""
    code = (
        "import resource, signal, sys, json; sys.path.insert(0, %r);"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN);"
        "from transport_procs import make_record; from layertap.transport.base import get_transport;"
        "sink = get_transport('file').make_sink({'path': %r, 'fsync': False}, 'w');"
        "sink.put(*make_record(0));"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000));"
        "\ntry:\n    sink.put(*make_record(1, tokens=4000))\nexcept Exception as e:\n    print(type(e).__name__, e)"
    ) % (str(HERE.parent), str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "req-1" in out.stdout and "TransportError" in out.stdout, out.stdout + out.stderr
    assert [r.key for r in FileDataset(tmp_path)] == ["req-0"]


def test_unwritable_output_directory_is_a_named_error(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    target.chmod(0o500)
    if os.access(target, os.W_OK):  # root ignores permission bits
        target.chmod(0o700)
        (tmp_path / "file").write_text("x")
        target = tmp_path / "file" / "sub"
    with pytest.raises(TransportError, match=str(target.name)):
        FILE.prepare({"path": str(target)})
