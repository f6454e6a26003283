"""The lean CUDA record path (``record_writer.WorkerSide._gather_group_lean``: the gather on the forward stream,
its index from a page-locked ring, byte-offset reservations, raw cudaMemcpyAsync payload and commit copies),
run through the worker's own ``finished`` into a real registered shm pool, no vLLM needed. Each record must
carry exactly its blocks' rows, also when the forward stream rewrites those blocks right after the step (the
next forward's writes), when the ring of index buffers wraps while the GPU is behind, and it must not be
visible before its payload landed. A control shows the rewrite test can fail: the same rewrite queued on
another stream, not after the gather, corrupts the record. Each runs twice: with the record process
(``record_proc``, the default: the step thread gathers into a staging ring shared through CUDA IPC, the process
copies and commits), with that process copying in pieces, and with the step thread doing it all (connector option
``offload=False``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from layertap.engine.saves import LayertapMetadata, SaveJob
from layertap.records import LAYER_SEMANTICS, token_digest
from layertap.transport.base import get_transport
from tests.unit.transport_procs import take

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from record_path_cost import make_worker  # noqa: E402  (a WorkerSide as register leaves it, no engine)

SHM = get_transport("shm")
PLANES, HIDDEN, BS, BLOCKS, ROWS = 4, 512, 16, 256, 200
SLEEP = 200_000_000  # GPU cycles (~0.1 s): holds a stream back so the host acts while work is queued


OPTIONS = {"offload": {}, "offload-pieces": {"offload_copy_chunk_kb": 64}, "in-process": {"offload": False}}
"""The default (the record process reserves, copies and commits: ``record_proc``), the same with each record's
copy in 64 KiB pieces (a record here is 800 KiB: 13 pieces, the last one short), and the step thread doing it all."""


def make(options: dict):
    cfg = SHM.prepare({"slot_bytes": 4 << 20, "num_slots": 64, "checksum": "none"})
    src = SHM.make_source(cfg)
    view = torch.randn(BLOCKS, BS, PLANES, HIDDEN, device="cuda").to(torch.bfloat16)  # vLLM 0.25's layout
    w = make_worker(view, HIDDEN, BS, cfg, [1, 2, 3, 4], options)
    assert (w.rp is not None) == options.get("offload", True), "the record process did not start"
    return w, src, view


@pytest.fixture(params=list(OPTIONS))
def setup(request):
    w, src, view = make(OPTIONS[request.param])
    yield w, src, view
    torch.cuda.synchronize()
    w.close()
    src.close()


def jobs(step: int, n: int, rng: np.random.Generator, spans=None) -> list[SaveJob]:
    out = []
    for r in range(n):
        blocks = rng.choice(np.arange(1, BLOCKS), size=-(-ROWS // BS), replace=False).tolist()
        ids = rng.integers(0, 2048, size=ROWS, dtype=np.int64)
        key = f"t:{step}-{r}"
        meta = {"key": key, "request_id": f"{step}-{r}", "index": step * n + r, "mode": "prompt",
                "layer_ids": [1, 2, 3, 4], "num_tokens": ROWS, "num_prompt_tokens": ROWS,
                "token_digest": token_digest(ids), "layer_semantics": LAYER_SEMANTICS, "run": "t",
                "loss_spans": spans}
        out.append(SaveJob(f"{step}-{r}", key, blocks, ids, ROWS, meta))
    return out


def expected(view: torch.Tensor, job: SaveJob) -> torch.Tensor:
    return view[job.block_ids].reshape(-1, PLANES, HIDDEN)[:ROWS].cpu()


def assert_rows(src, want: dict) -> None:
    """Every record of ``want`` (key -> expected rows) arrives, holding exactly those rows."""
    for key, rec in take(src, len(want)).items():
        assert torch.equal(rec.hidden_states, want[key]), key
        rec.release()


def test_the_lean_path_is_the_default_and_records_hold_their_blocks_rows(setup):
    w, src, view = setup
    assert w.lean, "the lean record path did not start (no CUDA runtime library mapped?)"
    assert w.rp is not None or not w.offload_wanted
    rng = np.random.default_rng(0)
    want = {}
    for step in range(3):
        js = jobs(step, 1 + step, rng, spans=[[3, 50], [120, 199]])
        want.update({j.key: (j, expected(view, j)) for j in js})
        assert w.finished(LayertapMetadata(saves=js)) == {j.req_id for j in js}
    got = take(src, len(want))
    for key, rec in got.items():
        job, rows = want[key]
        assert torch.equal(rec.hidden_states, rows), key
        assert rec.token_ids.tolist() == job.token_ids.tolist()
        mask = torch.zeros(ROWS, dtype=torch.uint8)
        mask[3:50] = 1
        mask[120:199] = 1
        assert torch.equal(rec.loss_mask.to(torch.uint8), mask)
        rec.release()


def test_blocks_rewritten_on_the_forward_stream_right_after_the_step_do_not_reach_the_record(setup):
    w, src, view = setup
    rng = np.random.default_rng(1)
    js = jobs(0, 4, rng)
    want = {j.key: expected(view, j) for j in js}
    torch.cuda._sleep(SLEEP)  # the step's forward is still running when the record path is queued
    w.finished(LayertapMetadata(saves=js))
    for j in js:  # the next forward reuses the released blocks at once
        view[j.block_ids] = -7.0
    assert_rows(src, want)


def test_control_a_rewrite_not_ordered_after_the_gather_corrupts_the_record(setup):
    """The same rewrite, queued on another stream that does not wait for the forward stream: it overtakes the
    held-back gather, and the record carries the new values. So the test above can fail."""
    w, src, view = setup
    rng = np.random.default_rng(2)
    js = jobs(0, 1, rng)
    want = expected(view, js[0])
    torch.cuda._sleep(SLEEP)
    w.finished(LayertapMetadata(saves=js))
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        view[js[0].block_ids] = -7.0
    rec = take(src, 1)[js[0].key]
    assert not torch.equal(rec.hidden_states, want)
    assert bool((rec.hidden_states == -7.0).all())
    rec.release()


def test_the_index_ring_wraps_while_the_gpu_is_behind(setup):
    w, src, view = setup
    rng = np.random.default_rng(3)
    slots = w.index_upload.slots
    js = [j for step in range(slots + 5) for j in jobs(step, 1, rng)]
    want = {j.key: expected(view, j) for j in js}
    torch.cuda._sleep(SLEEP)  # every upload below is queued behind it: a ring row is reused only by its event
    for job in js:
        w.finished(LayertapMetadata(saves=[job]))
    assert_rows(src, want)


def test_no_record_is_visible_before_its_payload_landed(setup):
    w, src, view = setup
    rng = np.random.default_rng(4)
    js = jobs(0, 2, rng)
    want = {j.key: expected(view, j) for j in js}
    if w.rp is None:
        with torch.cuda.stream(w.copy_stream):
            torch.cuda._sleep(SLEEP)  # the payload and commit copies wait behind this
        w.finished(LayertapMetadata(saves=js))
    else:  # the record process's copies wait for the gather (an IPC event), held back on the forward stream
        torch.cuda._sleep(SLEEP)
        w.finished(LayertapMetadata(saves=js))
        time.sleep(0.03)  # the record process has the descriptor by now
    assert src.poll(0.0) == []  # queued, not landed: nothing visible
    assert_rows(src, want)


def test_record_process_ring_wraps_waits_and_takes_groups_larger_than_itself_in_process():
    """A 2 MiB staging ring: it holds two one-record groups (0.8 MiB each). The record process is stopped
    (SIGSTOP), so it frees nothing: the third group's step must wait for room, and goes on once the process
    runs again. (Holding the forward stream back with a timed kernel instead raced the host loop: on the H100
    the loop outlasted the kernel and no step waited.) Then twelve groups wrap the ring, and a four-record
    group (3.3 MiB), which never fits, takes the in-process lean path. Every record holds its rows."""
    import os
    import signal
    import threading

    w, src, view = make({"offload_staging_mb": 2})
    try:
        rng = np.random.default_rng(5)
        want = {}

        def step(js):
            want.update({j.key: expected(view, j) for j in js})
            w.finished(LayertapMetadata(saves=js))

        os.kill(w.rp.proc.pid, signal.SIGSTOP)
        try:
            step(jobs(0, 1, rng))
            step(jobs(1, 1, rng))
            assert w.rp.waits == 0
            third = threading.Thread(target=step, args=(jobs(2, 1, rng),))
            third.start()
            deadline = time.monotonic() + 30
            while w.rp.waits == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert w.rp.waits == 1 and third.is_alive()  # the step waits: the ring is full, nothing is freed
        finally:
            os.kill(w.rp.proc.pid, signal.SIGCONT)
        third.join(60)
        assert not third.is_alive()
        for s in range(3, 12):
            step(jobs(s, 1, rng))
        step(jobs(99, 4, rng))
        assert_rows(src, want)
        assert w.rp.sent == 12 and w.rp.waits >= 1
    finally:
        torch.cuda.synchronize()
        w.close()
        src.close()


def test_a_record_process_killed_mid_run_fails_the_next_step_by_name():
    import os
    import signal

    from layertap.engine.record_proc import RecordProcessError

    w, src, view = make({})
    try:
        os.kill(w.rp.proc.pid, signal.SIGKILL)
        w.rp.proc.wait(30)
        with pytest.raises(RecordProcessError, match="gone"):
            w.finished(LayertapMetadata(saves=jobs(0, 1, np.random.default_rng(6))))
    finally:
        w.rp.close(drain=False)
        w.rp = None
        w.close()
        src.close()


def test_a_raw_event_query_before_the_work_ran_leaves_no_error_behind():
    """RawEvent.query on an event still behind queued work returns False and clears the runtime's "not ready"
    (left as the thread's last error), so torch's next launch check does not report it as a failure."""
    from layertap.engine.gpu_gather import RawCopies

    rt = RawCopies.load()
    assert rt is not None
    ev = rt.event(blocking=True)
    torch.cuda._sleep(SLEEP)
    ev.record(torch.cuda.current_stream().cuda_stream)
    assert ev.query() is False
    x = torch.ones(4, device="cuda") * 2  # a launch: torch checks the last error after it
    ev.synchronize()
    assert ev.query() is True and float(x.sum()) == 8.0
    other = torch.cuda.Stream()
    rt.wait_event(other.cuda_stream, ev)
    with torch.cuda.stream(other):
        y = x + 1
    other.synchronize()
    assert float(y.sum()) == 12.0
