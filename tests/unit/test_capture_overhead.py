"""benchmarks/capture_overhead.py without an engine: --cpus (CPU lists and NUMA nodes read as Linux writes them,
from a sysfs tree made here; bad specs refused by name), the host line every run prints, and the Timeline's
time outside a call's requests."""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import capture_overhead as co  # noqa: E402


def fake_sysfs(tmp_path: Path, nodes: dict[int, str]) -> str:
    for n, cpus in nodes.items():
        d = tmp_path / f"node{n}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node directory: ignored
    return str(tmp_path)


def test_cpu_lists_and_nodes(tmp_path):
    assert co.cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"})
    assert co.numa_nodes(root) == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert co.resolve_cpus("node:1", root) == [4, 5, 6, 7, 12, 13, 14, 15]
    assert co.resolve_cpus("2-3", root) == [2, 3]


def test_bad_specs_are_refused_by_name(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-1"})
    with pytest.raises(SystemExit, match=r"NUMA nodes are \[0\]"):
        co.resolve_cpus("node:3", root)
    with pytest.raises(SystemExit, match="bad CPU list"):
        co.resolve_cpus("0-x", root)
    with pytest.raises(SystemExit, match="not listed in"):
        co.resolve_cpus("node:0", str(tmp_path / "none"))


def test_host_line_names_the_cpus_this_run_may_use():
    line = co.host_line()
    assert line.startswith(f"host: {os.cpu_count()} CPUs") and f"may use {len(os.sched_getaffinity(0))} CPUs" in line


class _Out:
    def __init__(self, rid: str):
        self.request_id, self.finished, self.metrics = rid, True, None


class _Engine:
    """The two calls the Timeline wraps; ``step`` finishes every request added since the last one."""

    def __init__(self):
        self.waiting: list[str] = []

    def add_request(self, rid, *a, **k):
        self.waiting.append(rid)

    def step(self):
        done, self.waiting = self.waiting, []
        return [_Out(r) for r in done]


def test_timeline_keeps_each_calls_time_outside_its_requests():
    import time

    eng = _Engine()
    tl = co.Timeline(eng)
    for _ in range(2):  # two calls: 5 ms before the first admission, 5 ms after the last finish
        t0 = time.monotonic()
        time.sleep(0.005)
        eng.add_request("a")
        time.sleep(0.002)
        eng.step()
        time.sleep(0.005)
        tl.segment((t0, time.monotonic()))
    out = tl.summary(1)
    assert out["head_ms"] >= 5 and out["tail_ms"] >= 5
    assert 0 < out["outside"] < 1 and out["occupancy"] > 0.99
    tl.reset()
    eng.add_request("b")
    time.sleep(0.002)
    eng.step()
    tl.segment()  # a segment closed without its call's times: requests measured, nothing said of outside
    out = tl.summary(1)
    assert out["occupancy"] > 0.99 and "outside" not in out


class _Core:
    """vLLM's multiprocess client as the Timeline sees it: a receiving thread puts each engine output into
    ``outputs_queue``; ``get_output`` takes the next one."""

    def __init__(self):
        import queue

        self.outputs_queue = queue.Queue()

    def get_output(self):
        return self.outputs_queue.get(timeout=5)


class _Outputs:
    def __init__(self, finished: int):
        self.outputs = [type("O", (), {"finished": True})() for _ in range(finished)]


def test_late_is_split_by_what_the_driving_thread_was_doing():
    """An output that arrives while the driving thread is busy (here: in a named function) waits until it
    asks; that wait is charged to the function it was in, once per request the output finishes, and not at
    all for an output that finishes nothing. Bounds come from clock reads around the put and the ask."""
    import threading
    import time

    eng = _Engine()
    eng.engine_core = _Core()
    tl = co.Timeline(eng, late_by=True)
    q = eng.engine_core.outputs_queue
    put_at: list[float] = []

    spinning = [False]

    def deliver(item, done: threading.Event):
        deadline = time.monotonic() + 10
        while not spinning[0] and time.monotonic() < deadline:  # until the driving thread is in its busy loop
            time.sleep(0.001)
        put_at.append(time.monotonic())
        q.put_nowait(item)  # the Timeline's wrapper: stamps the arrival, samples the driving thread
        put_at.append(time.monotonic())
        done.set()

    def busy_elsewhere(item):
        done = threading.Event()
        th = threading.Thread(target=deliver, args=(item, done))
        th.start()
        deadline = time.monotonic() + 10
        spinning[0] = True  # from here until the output is in, this frame calls no Python function
        while len(put_at) < 2 and time.monotonic() < deadline:
            pass
        spinning[0] = False
        assert done.wait(10)
        th.join()
        time.sleep(0.01)

    charged = []
    for item in (_Outputs(finished=2), _Outputs(finished=0)):
        put_at.clear()
        busy_elsewhere(item)
        t0 = time.monotonic()
        assert eng.engine_core.get_output() is item
        t1 = time.monotonic()
        charged.append((t0 - put_at[1], t1 - put_at[0]))  # the wait lies between these
    (where, late), = tl.late_by.items()  # the output that finished nothing is not charged
    assert where == "? | test_capture_overhead.py:busy_elsewhere"  # no Tap or benchmark frame on that stack
    low, high = charged[0]
    assert 2 * low <= late <= 2 * high  # twice: the output finished two requests

    eng2 = _Engine()
    eng2.engine_core = _Core()
    quiet = co.Timeline(eng2, late_by=False)  # without --stats nothing is sampled or charged
    eng2.engine_core.outputs_queue.put_nowait(_Outputs(finished=2))
    time.sleep(0.01)
    eng2.engine_core.get_output()
    assert not quiet.late_by and quiet.last_get is not None and quiet.last_get[0] > quiet.last_get[1]


def test_how_many_requests_each_regime_keeps_in_the_engine():
    """Driver-bounded (default): the in-flight target. --queue: every prompt of the call (plain, floor), or
    twice the target for plain-ahead (the Tap's lookahead), never more than the call has."""
    from types import SimpleNamespace

    data = [[1, 2]] * 10
    assert co.submit_limit(SimpleNamespace(queue=False), 4, data) == 4
    assert co.submit_limit(SimpleNamespace(queue=False, ahead=True), 4, data) == 4
    assert co.submit_limit(SimpleNamespace(queue=True), 4, data) == 10
    assert co.submit_limit(SimpleNamespace(queue=True, ahead=True), 4, data) == 8
    assert co.submit_limit(SimpleNamespace(queue=True, ahead=True), 8, data) == 10


def test_wide_variants_get_more_seats_than_the_target_and_need_queue():
    """--queue: plain and capture run in engines whose max_num_seqs is the target; the -wide variants in engines
    of --wide-seqs seats, which the driver feeds the target (the regime without --queue). Without --queue they
    would be plain and capture again, so they are refused by name."""
    args = co.parse_args(["--queue", "--batch-sizes", "4", "--wide-seqs", "48", "--variants", "plain,plain-wide"])
    assert co.engine_kwargs(args)["max_num_seqs"] == 4
    assert co.engine_kwargs(args, wide=True)["max_num_seqs"] == 48
    plain = co.parse_args(["--batch-sizes", "4", "--variants", "plain"])
    for variant in ("plain-wide", "capture-wide"):
        with pytest.raises(SystemExit, match="need.* --queue"):
            co.VARIANTS[variant]("/nonexistent-model", [[1, 2]], plain)
