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


class _Rows:
    def record_stream(self, stream):
        pass


class _DevRes:
    def __init__(self):
        self.tensors = {"hidden_states": object()}
        self.commit_target = object()
        self.handed = False

    def handed_to_device(self):
        self.handed = True


def test_cuda_record_path_times_its_phases(monkeypatch):
    """The CUDA path's per-phase timers (logged per record at close, so a GPU run says which part of the
    record path costs the step its time) add up within the step timer. The GPU calls are stand-ins here;
    tests/gpu runs them for real."""
    import logging

    from layertap.engine import record_writer as rw
    from layertap.engine.saves import LayertapMetadata, SaveJob

    monkeypatch.setattr(rw, "gather_on_device", lambda *a, **k: (_Rows(), "gathered", "keep"))
    monkeypatch.setattr(rw, "copy_to_host", lambda *a, **k: ([], "done"))
    w = writer()
    w.staged_bytes = 0
    w.c = NS(_block_size=16, _extra={})
    w.geo, w.row_bytes, w.ratio, w.num_manager_blocks = NS(view_block_size=16), 64, 1, 1000
    w.view, w.stream, w.copy_stream, w.commit_word = None, None, None, "word"
    w.error, w.released, w.inflight, w.rank0, w.on_cuda, w.skip_reads = None, set(), [], True, True, False
    w.lean, w.gather_only, w.rp = False, False, None  # the torch record path (tests/gpu/test_lean_path.py runs the lean one)
    w.busy_s, w.calls, w.saved, w.phase_s = 0.0, 0, 0, dict.fromkeys(rw.PHASES, 0.0)
    rings = []
    w.writer, w.pinned_region, w.sink = None, None, NS(close=lambda: None, wake_consumer=lambda: rings.append(1))
    made = []
    w._reserve = lambda job, device: made.append(_DevRes()) or made[-1]
    import numpy as np

    saves = [SaveJob(f"r{i}", f"k{i}", list(range(4 * i, 4 * i + 4)), np.arange(60), 60, {}) for i in range(3)]
    assert w.finished(LayertapMetadata(saves=saves)) == {"r0", "r1", "r2"}
    assert w.finished(LayertapMetadata()) is None
    assert all(r.handed for r in made) and len(made) == 3 and w.saved == 3
    assert len(rings) == 1  # the consumer is rung once for the group handed to the device, not per record
    assert all(v >= 0 for v in w.phase_s.values()) and w.phase_s["reserve"] > 0
    assert sum(w.phase_s.values()) <= w.busy_s
    lines = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logger = logging.getLogger("vllm.layertap")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        w.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    per_record = [ln for ln in lines if "record path per record" in ln]
    assert len(per_record) == 1 and all(p in per_record[0] for p in rw.PHASES), lines
