"""The connector writer's all-or-nothing rule for one step's records (no engine, no GPU: the host-copy event
and the transport reservations are stand-ins here; the GPU tests run the real path and check every record
against HF). A failed wait aborts every reservation; a record that fails to commit aborts the ones after
it, so nothing stays reserved and nothing half-written becomes visible."""

import threading
from types import SimpleNamespace as NS

import pytest

from layertap.engine.record_writer import WorkerSide


class Res:
    def __init__(self, log, name, fail=False):
        self.log, self.name, self.fail = log, name, fail

    def commit(self):
        if self.fail:
            raise OSError(f"commit {self.name} failed")
        self.log.append(("commit", self.name))

    def abort(self):
        self.log.append(("abort", self.name))


class Done:
    def __init__(self, fail=False):
        self.fail = fail

    def synchronize(self):
        if self.fail:
            raise RuntimeError("copy failed")


def writer():
    w = object.__new__(WorkerSide)
    w.staging, w.staged_bytes = threading.Condition(), 300
    return w


def jobs(n):
    return [NS(key=f"k{i}") for i in range(n)]


def test_all_records_commit_and_staging_is_released():
    w, log = writer(), []
    res = [Res(log, i) for i in range(3)]
    w._write_copied(jobs(3), [None] * 3, res, Done(), keep=object(), nbytes=300)
    assert log == [("commit", 0), ("commit", 1), ("commit", 2)] and w.staged_bytes == 0


def test_failed_copy_aborts_every_reservation():
    w, log = writer(), []
    res = [Res(log, i) for i in range(3)]
    with pytest.raises(RuntimeError, match="copy failed"):
        w._write_copied(jobs(3), [None] * 3, res, Done(fail=True), keep=object(), nbytes=300)
    assert log == [("abort", 0), ("abort", 1), ("abort", 2)] and w.staged_bytes == 0


def test_failed_commit_aborts_the_records_after_it():
    w, log = writer(), []
    res = [Res(log, 0), Res(log, 1, fail=True), Res(log, 2), None]
    with pytest.raises(OSError, match="commit 1"):
        w._write_copied(jobs(4), [None] * 4, res, Done(), keep=object(), nbytes=300)
    assert log == [("commit", 0), ("abort", 2)]
