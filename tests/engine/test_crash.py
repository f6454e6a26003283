"""kill -9 of the vLLM engine process mid-capture: the consumer gets a named error within seconds (no hang),
and no shared-memory segment is left behind once the Tap is closed. An engine that hangs (its processes
stopped with SIGSTOP: a real hang, from outside) at start-up or in a step ends in the watchdog's named
error, which says where its processes stand, and leaves no process and no shared memory behind."""

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from layertap.models.tiny import tiny_model
from layertap.engine.watchdog import EngineStartTimeout, EngineStepTimeout
from layertap.tap import CaptureError, Tap

from .helpers import BASE, random_prompts

pytestmark = pytest.mark.engine


def segments() -> set[str]:
    """This process's shm pools (names carry the creator's pid): other runs on the machine do not count."""
    return {p.name for p in Path("/dev/shm").glob(f"layertap-{os.getpid()}-*")}


def engine_children() -> list[psutil.Process]:
    kids = psutil.Process().children(recursive=True)
    return [c for c in kids if "resource_tracker" not in " ".join(c.cmdline())]


def test_kill_engine_mid_capture_names_the_failure_and_leaks_nothing():
    before = segments()
    tap = Tap(model=tiny_model("qwen3"), layers=[1, 4], **BASE, max_num_seqs=4)  # shm stream (no --out)
    assert segments() - before, "the Tap should have created its shm pool (named after this pid)"
    children = psutil.Process().children(recursive=True)
    engine = [c for c in children if "EngineCore" in " ".join(c.cmdline()) or "EngineCore" in c.name()]
    victims = engine or children
    it = tap.capture(random_prompts(64, [200, 400], seed=31))
    next(it)  # records are flowing
    for p in victims:
        os.kill(p.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(Exception) as exc:
        for _ in it:
            pass
    took = time.monotonic() - t0
    assert took < 30, f"the failure took {took:.0f}s to surface"
    assert isinstance(exc.value, CaptureError) and "the vLLM engine died" in str(exc.value), repr(exc.value)
    tap.close()
    deadline = time.monotonic() + 10
    while segments() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not segments() - before, f"leaked shm segments: {segments() - before}"


def test_engine_hung_at_start_up_is_named_and_cleaned_up():
    """Every process the engine start spawns is stopped as soon as it appears: start-up never ends. The
    watchdog's limit turns that into EngineStartTimeout naming the stopped process; nothing is left."""
    before_kids = {c.pid for c in psutil.Process().children(recursive=True)}
    stopped: list[int] = []
    done = threading.Event()

    def stop_new_children() -> None:
        while not done.is_set():
            for c in psutil.Process().children(recursive=True):
                if c.pid not in before_kids and c.pid not in stopped and "resource_tracker" not in " ".join(c.cmdline()):
                    os.kill(c.pid, signal.SIGSTOP)
                    stopped.append(c.pid)
            time.sleep(0.02)

    th = threading.Thread(target=stop_new_children, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineStartTimeout) as exc:
            Tap(model=tiny_model("qwen3"), layers=[1, 4], **BASE, max_num_seqs=4, start_timeout=15)
    finally:
        done.set()
        th.join()
    took = time.monotonic() - t0
    msg = str(exc.value)
    assert stopped and f"pid {stopped[0]}" in msg and "state T" in msg, msg  # T: stopped
    assert "did not finish starting within 15 s" in msg
    assert took < 60, f"took {took:.0f}s"
    assert not segments(), f"leaked shm segments: {segments()}"
    left = [p for p in psutil.wait_procs([psutil.Process(p) for p in stopped if psutil.pid_exists(p)], timeout=10)[1]
            if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"engine processes left behind: {left}"


@pytest.fixture(scope="module")
def small_pool_tap():
    """One engine for the last two tests: zero-copy records over a 2-slot pool, a 5 s step limit."""
    tap = Tap(model=tiny_model("qwen3"), layers=[1, 4], **BASE, max_num_seqs=4, zero_copy=True,
              transport_config={"num_slots": 2, "slot_bytes": 1 << 20}, step_timeout=5)
    yield tap
    tap.close()


def test_zero_copy_records_never_released_fail_loudly_not_hang(small_pool_tap):
    from layertap.transport.base import TransportFull

    tap = small_pool_tap
    tap.stall_timeout = 1.0
    held = []
    with pytest.raises(TransportFull, match="rec.release"):
        for rec in tap.capture(random_prompts(8, [20], seed=32)):
            held.append(rec)  # never released: the 2-slot pool fills
    assert len(held) == 2
    for rec in held:
        rec.release()
    # Released: the same Tap goes on.
    got = [r.index for r in tap.capture(random_prompts(3, [20], seed=33)) if not r.release()]
    assert sorted(got) == [0, 1, 2]


def test_engine_hung_in_a_step_is_named_and_cleaned_up(small_pool_tap):
    """The engine's processes are stopped between two captures: the next step never returns. The step
    limit (5 s) turns that into EngineStepTimeout naming them; closing the Tap leaves nothing behind."""
    tap = small_pool_tap
    kids = engine_children()
    assert kids
    for c in kids:
        os.kill(c.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(EngineStepTimeout) as exc:
        list(tap.capture(random_prompts(2, [20], seed=34)))
    took = time.monotonic() - t0
    msg = str(exc.value)
    assert "did not return from one engine step within 5 s" in msg and "state T" in msg, msg
    assert all(f"pid {c.pid}" in msg for c in kids), msg
    assert took < 30, f"took {took:.0f}s"
    tap.close()
    assert not segments(), f"leaked shm segments: {segments()}"
    left = [p for p in psutil.wait_procs(kids, timeout=10)[1] if p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"engine processes left behind: {left}"
