"""kill -9 of the vLLM engine process mid-capture: the consumer gets a named error within seconds (no hang),
and no shared-memory segment is left behind once the Tap is closed."""

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from layertap.models.tiny import tiny_model
from layertap.tap import CaptureError, Tap

from .helpers import BASE, random_prompts

pytestmark = pytest.mark.engine


def segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("layertap-*")}


def test_kill_engine_mid_capture_names_the_failure_and_leaks_nothing():
    before = segments()
    tap = Tap(model=tiny_model("qwen3"), layers=[1, 4], **BASE, max_num_seqs=4)  # shm stream (no --out)
    assert segments() - before, "the Tap should have created its shm pool"
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


def test_zero_copy_records_never_released_fail_loudly_not_hang():
    from layertap.transport.base import TransportFull

    before = segments()
    with Tap(model=tiny_model("qwen3"), layers=[1, 4], **BASE, max_num_seqs=4, zero_copy=True,
             transport_config={"num_slots": 2, "slot_bytes": 1 << 20}) as tap:
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
    assert not segments() - before
