"""The inference manager: runs capture in a producer thread and hands proven records to the trainer.

- Bounded in flight: the ``Tap`` admits a request only while ``max_inflight`` and the transport's free
  capacity allow; the hand-over queue is bounded too, so a slow trainer slows the engine, never grows memory.
- Count guard: every submitted input ends as a record or a named rejection (too long for the engine);
  anything else is missing and is named.
- One retry: inputs without a record after a pass (a failed request, a dead engine) run once more on a
  fresh engine; still missing after that raises ``RequestsFailed`` naming them and the first error.
- Rates: producer records/s and tokens/s, consumer records/s, and the trainer's idle fraction (time
  blocked waiting for a record / time since the first record).

vLLM's engine core is a separate process, so the producer thread mostly waits on IPC; the trainer runs
in the calling thread. Errors raised in the producer are re-raised in the consumer, never swallowed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from layertap.data import InputItem
from layertap.errors import CaptureError
from layertap.records import Record

log = logging.getLogger("layertap")

_END = object()


class RequestsFailed(RuntimeError):
    """Inputs that produced no record after one retry; the message names them."""


class TapLike(Protocol):
    rejected: list[Any]

    def capture(self, inputs: Any, *, mode: str = ..., sampling_params: Any = ...,
                skip_indices: set[int] | None = ...) -> Iterator[Record]: ...

    def close(self) -> None: ...


@dataclass
class Rates:
    """Throughput counters; ``summary()`` is what the run report prints."""

    submitted: int = 0
    records: int = 0
    tokens: int = 0
    retried: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    produce_start: float | None = None
    produce_end: float | None = None
    first_record: float | None = None
    startup_wait_s: float = 0.0
    idle_s: float = 0.0
    consumed: int = 0
    consumed_tokens: int = 0
    consume_end: float | None = None

    def summary(self) -> dict[str, float | int]:
        prod = max((self.produce_end or time.monotonic()) - (self.produce_start or time.monotonic()), 1e-9)
        cons = max((self.consume_end or time.monotonic()) - (self.first_record or time.monotonic()), 1e-9)
        return {
            "submitted": self.submitted, "records": self.records, "rejected": len(self.rejected),
            "retried": len(self.retried), "producer_wall_s": round(prod, 2),
            "producer_records_per_s": round(self.records / prod, 2),
            "producer_tokens_per_s": round(self.tokens / prod, 1), "producer_tokens": self.tokens,
            "consumer_records": self.consumed, "consumer_wall_s": round(cons, 2),
            "consumer_records_per_s": round(self.consumed / cons, 2),
            "consumer_tokens_per_s": round(self.consumed_tokens / cons, 1), "consumer_tokens": self.consumed_tokens,
            "trainer_startup_wait_s": round(self.startup_wait_s, 2),
            "trainer_idle_s": round(self.idle_s, 2),
            "trainer_idle_fraction": round(self.idle_s / cons, 4),
        }


class InferenceManager:
    """Producer thread over ``tap_factory()``'s ``capture``; consume with ``records()``; always ``close()``."""

    def __init__(self, tap_factory: Callable[[], TapLike], items: list[InputItem], *, mode: str = "prompt",
                 sampling_params: Any = None, skip: set[int] | None = None, queue_records: int = 32,
                 retries: int = 1, should_stop: Callable[[], bool] | None = None):
        """``should_stop``: asked before a retry (and when a pass fails) whether the run is being stopped
        (``layertap train`` passes its signal check): an engine that died of the user's Ctrl-C is not
        restarted."""
        self.factory = tap_factory
        self.items = [it for it in items if not skip or it.index not in skip]
        self.mode, self.sp, self.retries = mode, sampling_params, retries
        self._should_stop = should_stop or (lambda: False)
        self.q: queue.Queue[Any] = queue.Queue(maxsize=queue_records)
        self.stop = threading.Event()
        self.rates = Rates(submitted=len(self.items))
        self._tap: TapLike | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, name="layertap-producer", daemon=True)

    # -- producer ------------------------------------------------------------------------------------
    def start(self) -> "InferenceManager":
        self._thread.start()
        return self

    def _produce(self) -> None:
        try:
            self._run_passes()
        except BaseException as e:  # surfaced to the consumer by records()
            self._error = e
        finally:
            self.rates.produce_end = time.monotonic()
            self._put(_END, final=True)

    def _run_passes(self) -> None:
        received: set[int] = set()
        pending, first_error = list(self.items), None
        for attempt in range(1 + self.retries):
            if attempt:
                self.rates.retried += [it.index for it in pending]
                log.warning("retrying %d inputs once on a fresh engine: %s", len(pending),
                            ", ".join(str(it.index) for it in pending[:20]))
            err = self._one_pass(pending, received)
            if self._stopping():
                return
            first_error = first_error or err
            pending = [it for it in pending if it.index not in received and it.index not in self.rates.rejected]
            if not pending:
                return
        raise RequestsFailed(self._missing_message(pending, first_error))

    def _missing_message(self, pending: list[InputItem], err: BaseException | None) -> str:
        names = ", ".join(str(it.index) for it in pending[:20]) + (" ..." if len(pending) > 20 else "")
        why = f"first error: {type(err).__name__}: {err}" if err else "the engine returned no record for them"
        return (f"{len(pending)} of {self.rates.submitted} submitted inputs have no record after "
                f"{self.retries} retry: input indices {names}; {why}")

    def _one_pass(self, todo: list[InputItem], received: set[int]) -> BaseException | None:
        """Run ``todo`` through a Tap; returns the error that ended the pass early (the Tap is then
        closed, so the retry gets a fresh engine), or None."""
        with self._lock:
            if self._stopping():
                return None
            if self._tap is None:
                self._tap = self.factory()
            tap = self._tap
        if self.rates.produce_start is None:
            self.rates.produce_start = time.monotonic()
        n_rej = len(tap.rejected)
        try:
            for rec in tap.capture(todo, mode=self.mode, sampling_params=self.sp):
                if rec.index in received:
                    raise RequestsFailed(f"input index {rec.index} produced a second record ({rec.key})")
                received.add(rec.index)
                self.rates.records += 1
                self.rates.tokens += int(rec.token_ids.shape[0])
                if not self._put(rec):
                    return None
        except CaptureError as e:
            if self._stopping():
                return None
            log.error("capture pass ended early: %s", e)
            self._close_tap()
            return e
        finally:
            for r in tap.rejected[n_rej:]:
                self.rates.rejected[r.index] = r.reason
        return None

    def _stopping(self) -> bool:
        return self.stop.is_set() or self._should_stop()

    def _put(self, item: Any, final: bool = False) -> bool:
        """Blocking put that gives up when stopped (the consumer is gone); ``final`` always lands."""
        while True:
            try:
                self.q.put(item, timeout=0.1)
                return True
            except queue.Full:
                if self.stop.is_set():
                    if final:  # make room: the consumer is gone, the end marker must land
                        self._drain()
                        continue
                    return False

    # -- consumer ------------------------------------------------------------------------------------
    def records(self) -> Iterator[Record]:
        """Records in arrival order; raises the producer's error; ends when every input is accounted for."""
        while True:
            t0 = time.monotonic()
            item = self._get()
            now = time.monotonic()
            if item is _END:
                self.rates.consume_end = now
                if self._error is not None:
                    raise self._error
                return
            if self.rates.first_record is None:
                self.rates.first_record = now
                self.rates.startup_wait_s = now - t0  # engine start-up, not starvation
            else:
                self.rates.idle_s += now - t0
            self.rates.consumed += 1
            self.rates.consumed_tokens += int(item.token_ids.shape[0])
            self.rates.consume_end = now
            yield item

    def _get(self) -> Any:
        while True:
            try:
                return self.q.get(timeout=0.5)
            except queue.Empty:
                if not self._thread.is_alive() and self.q.empty():
                    raise RuntimeError("the producer thread ended without an end marker") from self._error

    def _drain(self) -> None:
        try:
            while True:
                self.q.get_nowait()
        except queue.Empty:
            return

    # -- shutdown ------------------------------------------------------------------------------------
    def _close_tap(self) -> None:
        with self._lock:
            tap, self._tap = self._tap, None
        if tap is not None:
            tap.close()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the producer, shut the engine down and free the transport (idempotent)."""
        self.stop.set()
        self._drain()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("producer thread still running after %.0fs; closing its engine under it", timeout)
        self._close_tap()
        self._drain()
