"""The ``shm`` transport: the default stream on one machine, through a reused shared-memory pool.

Who does what (see ``shm_pool`` for the layout and the slot life cycle):

- ``ShmTransport.prepare`` (consumer process, before the engine starts) creates and pre-allocates the
  pool ``/dev/shm/layertap-<pid>-<uuid>`` and registers it with Python's resource tracker, a separate process
  that unlinks it if the consumer dies without cleaning up (``kill -9``).
- ``ShmSink`` (vLLM worker process) maps the pool, registers itself as a writer, and ``put`` claims free
  slots, serializes the record straight into them, then commits (checksum + sequence number) under the
  pool lock. A full pool blocks ``put`` up to ``put_timeout`` s, then raises ``TransportFull``; a dead or
  closed consumer raises ``PeerGone`` at once (and the sink unlinks the orphaned pool name).
- ``ShmSource`` (consumer process) claims the consumer role, and ``poll`` hands out committed records in
  commit order, each verified (payload checksum, header, token-id digest) before it is returned. Records
  view their slot (zero copy): call ``Record.release()`` (or use ``with record:``) when done, or pass
  ``copy=True`` to get private tensors and have the slot freed at once. A writer that dies with records
  in flight makes ``poll`` raise ``PeerGone`` naming the writer and the lost keys (after every record it
  did commit has been delivered); its half-written slots are reclaimed.

Nothing here listens on any socket.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from multiprocessing import resource_tracker
from typing import Any

import numpy as np
import torch

from layertap.records import (
    IntegrityError, Record, RecordError, deserialize, layout, serialize_into, serialized_size, to_record,
)
from layertap.transport import shm_pool as sp
from layertap.transport.base import (
    PeerGone, Reservation, Sink, Source, Transport, TransportError, TransportFull, register,
)

DEFAULT_SLOT_BYTES = 64 << 20
DEFAULT_NUM_SLOTS = 16
DEFAULT_PUT_TIMEOUT = 60.0
# No payload checksum by default: within one host the threat is a torn or half-written record, which the
# slot commit protocol rules out, and every record's token digest is still checked. A crc32 over each
# payload costs most of the bandwidth (measured 0.10-0.21 of memcpy with it, 0.57-0.86 without, 16-64 MB).
DEFAULT_CHECKSUM = "none"
_LIVENESS_EVERY = 0.2  # seconds between /proc checks of the peers while waiting
_TRACKED: set[str] = set()  # pool names this process registered with the resource tracker


class RecordTooLarge(TransportError):
    """A record is larger than the whole pool; it can never fit."""


_MAX_WAIT = 0.05  # longest single wait between re-checks of the pool (rings usually end it sooner)
_DEVICE_WAIT = 0.0005  # the same while a device commit is pending (it rings no bell)


class ShmSink(Sink):
    """Producer side. Not thread-safe per instance; use one sink per worker thread or a lock."""

    def __init__(self, config: dict[str, Any], writer_id: str):
        self.pool = sp.Pool(config["name"])
        self.name = config["name"]
        self.put_timeout = float(config.get("put_timeout", DEFAULT_PUT_TIMEOUT))
        self.checksum = str(config.get("checksum", DEFAULT_CHECKSUM))
        sp.checksum(memoryview(b""), self.checksum)  # validates the name
        self.writer = self.pool.register_writer(writer_id)
        self.bell = sp.Doorbell(sp.writer_bell(self.name, self.writer))
        self.writer_id = writer_id
        self._next_consumer_check = 0.0
        self._commit_targets: dict[int, torch.Tensor] = {}  # slot -> view of its state word (device commits)
        self.waits = 0
        """How many puts had to wait for a free slot (backpressure observed by this sink)."""

    def _check_consumer(self, key: str) -> None:
        pid, start, closed = self.pool.consumer()
        if closed:
            raise PeerGone(f"shm pool {self.name}: consumer closed the pool; record {key} not committed")
        if pid and not sp.alive(pid, start):
            self._unlink_orphan()
            raise PeerGone(f"shm pool {self.name}: consumer pid {pid} died; record {key} not committed")

    def _unlink_orphan(self) -> None:
        # The consumer that owned the pool is dead, so nobody can read it again: free the name now
        # rather than wait for the last mapper to exit.
        try:
            os.unlink(sp.segment_path(self.name))
        except FileNotFoundError:
            pass  # the consumer's resource tracker got there first

    def _key_bytes(self, key: str) -> bytes:
        kb = key.encode()
        if len(kb) > sp.MAX_KEY_BYTES:
            raise ValueError(f"record key {key[:40]!r}... is {len(kb)} bytes; the shm limit is {sp.MAX_KEY_BYTES}")
        return kb

    def _span(self, key: str, size: int) -> int:
        span = sp.round_up(size, self.pool.slot_bytes) // self.pool.slot_bytes
        if span > self.pool.num_slots:
            raise RecordTooLarge(
                f"record {key} needs {size} bytes; shm pool {self.name} holds "
                f"{self.pool.num_slots} x {self.pool.slot_bytes} bytes"
            )
        return span

    def _claim(self, key: str, span: int) -> int:
        kb = self._key_bytes(key)
        deadline = time.monotonic() + self.put_timeout
        next_check, waited = 0.0, False
        while True:
            now = time.monotonic()
            if now >= next_check:
                self._check_consumer(key)
                next_check = now + _LIVENESS_EVERY
            head = self.pool.claim(span, self.writer, kb)
            if head is not None:
                self.waits += waited
                return head
            if now >= deadline:
                raise TransportFull(
                    f"shm pool {self.name}: no {span} free slot(s) for record {key} within {self.put_timeout} s "
                    f"(consumer not keeping up); not committed"
                )
            waited = True
            self.bell.wait(min(_MAX_WAIT, deadline - now))  # the consumer rings on every release

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Commit one record or raise (``TransportFull``, ``PeerGone``, ``RecordTooLarge``)."""
        span = self._span(key, serialized_size(tensors, meta))
        head = self._claim(key, span)
        try:
            view = self.pool.data(head, span)
            n = serialize_into(view, tensors, meta)
            cks = sp.checksum(view[:n], self.checksum)
            view.release()
        except BaseException:
            with self.pool.locked():
                self.pool.free(head)
            raise
        self.pool.commit(head, n, cks)
        self.bell.ring(sp.consumer_bell(self.name))

    @property
    def device_commit_ok(self) -> bool:
        """Whether a reservation may be committed by the device (``reserve(..., device_commit=True)``): only
        without a payload checksum, which the CPU would have to compute over the landed payload."""
        return self.checksum == "none"

    def commit_word(self) -> torch.Tensor:
        """The 4-byte value a device commit copies into ``ShmReservation.commit_target``."""
        return torch.tensor([sp.COMMITTED], dtype=torch.int32)

    def reserve(self, key: str, specs: dict[str, Any], meta: dict[str, Any], *, template: Any = None,
                device_commit: bool = False, views: bool = True) -> "ShmReservation | None":
        """Claim slots for the record now (``None`` if none are free: never waits), write its header, and
        return tensors that view the slot memory for the producer to fill (e.g. a GPU copy straight into
        shared memory, no host staging). Nothing is visible to the consumer before ``commit``.

        ``device_commit``: the record becomes visible when ``commit_word()`` lands in the reservation's
        ``commit_target`` (a view of its slot's state word), copied there by the device after the payload;
        the producer then calls ``handed_to_device()`` instead of ``commit()``, and ``wake_consumer()`` once
        for the batch.

        ``views=False``: no tensors (``tensors`` and ``commit_target`` stay empty); the producer writes
        through the byte offsets in ``offsets`` (each field's start in the mapping that ``data_region``
        views) and ``state_at`` (the slot's state word), e.g. with raw device copies: no torch call per
        record."""
        if device_commit and not self.device_commit_ok:
            raise TransportError(f"shm pool {self.name}: a device commit needs checksum 'none', not {self.checksum!r}")
        prefix, spans, total = layout(specs, meta, template)
        span = self._span(key, total)
        now = time.monotonic()
        if now >= self._next_consumer_check:  # a /proc read: at most every _LIVENESS_EVERY s, not per record
            self._check_consumer(key)
            self._next_consumer_check = now + _LIVENESS_EVERY
        head = self.pool.claim(span, self.writer, self._key_bytes(key), device_length=total if device_commit else None)
        if head is None:
            return None
        try:
            # Per record on the engine's step thread: one torch call per tensor (a typed view of the mapping
            # at the slot's offset), and the slot's commit-word view made once per slot, not per record.
            base = self.pool.data_offset(head)
            self.pool.mm[base : base + len(prefix)] = prefix
            tensors = {}
            offsets = {name: base + pos for name, (pos, _) in spans.items()}
            for name, spec in (specs.items() if views else ()):
                dtype, shape = (spec.dtype, tuple(spec.shape)) if isinstance(spec, torch.Tensor) else spec
                pos, nbytes = spans[name]
                if nbytes:
                    tensors[name] = torch.frombuffer(self.pool.mm, dtype=dtype, count=nbytes // dtype.itemsize,
                                                     offset=base + pos).view(shape)
                else:
                    tensors[name] = torch.empty(shape, dtype=dtype)
            target = None
            if device_commit and views:
                target = self._commit_targets.get(head)
                if target is None:
                    target = torch.frombuffer(self.pool.mm, dtype=torch.int32, count=1,
                                              offset=self.pool.state_offset(head))
                    self._commit_targets[head] = target
        except BaseException:
            with self.pool.locked():
                self.pool.free(head)
            raise
        return ShmReservation(self, key, head, span, total, tensors, target, offsets=offsets,
                              state_at=self.pool.state_offset(head), device_commit=device_commit)

    def wake_consumer(self) -> None:
        """Ring the consumer once after handing records to the device (``handed_to_device``). A consumer that
        was already waiting when they were claimed sees no pending device commit and sleeps its longest wait
        (``_MAX_WAIT``, 50 ms) before it looks again, however soon they land: e.g. generate-mode records,
        saved after their requests finished, while the Tap or a trainer waits for them. Rung, it rescans and
        watches their state words closely. One ring covers any number of records: a producer rings once per
        batch it queued, not per record."""
        self.bell.ring(sp.consumer_bell(self.name))

    def data_region(self) -> torch.Tensor:
        """The whole pool mapping (header, tables, slots) as one uint8 tensor, for registering it with a
        device driver: device-to-host copies then land in the slots directly, and a device commit's state
        word in the slot table."""
        return torch.frombuffer(memoryview(self.pool.mm), dtype=torch.uint8)

    def _commit_reserved(self, res: "ShmReservation") -> None:
        data = self.pool.data(res.head, res.span)[: res.length]
        cks = sp.checksum(data, self.checksum)
        data.release()
        self.pool.commit(res.head, res.length, cks)
        self.bell.ring(sp.consumer_bell(self.name))

    def close(self) -> None:
        if self.pool.mm.closed:
            return
        with self.pool.locked():
            state, pid, start, name = self.pool.writer(self.writer)
            self.pool.set_writer(self.writer, sp.W_CLOSED, pid, start, name)
        self._commit_targets.clear()  # views of the mapping: dropped so it can be unmapped
        self.pool.close()
        self.bell.close()


class ShmReservation(Reservation):
    """Slots claimed by ``ShmSink.reserve``; ``tensors`` view them. Commit or abort exactly once."""

    def __init__(self, sink: ShmSink, key: str, head: int, span: int, length: int,
                 tensors: dict[str, torch.Tensor], commit_target: torch.Tensor | None = None, *,
                 offsets: dict[str, int] | None = None, state_at: int = 0, device_commit: bool = False):
        self.sink, self.key, self.head, self.span, self.length, self.tensors = sink, key, head, span, length, tensors
        self.commit_target = commit_target
        """Device commit with views: the slot's state word (int32, in the mapping); ``commit_word()`` goes there."""
        self.offsets = offsets or {}
        """Each field's first byte in the pool's mapping (``ShmSink.data_region``)."""
        self.state_at = state_at
        """The slot's state word in the mapping (where a device commit lands)."""
        self.device_commit = device_commit
        self._done = False

    def commit(self) -> None:
        if self._done:
            raise TransportError(f"record {self.key}: reservation already committed or aborted")
        self._done = True
        self.tensors = {}
        self.commit_target = None
        self.sink._commit_reserved(self)

    def handed_to_device(self) -> None:
        """The device's copies (payload, then the commit word) are queued: the record commits itself when
        they land. Nothing may abort it any more."""
        if self._done or not self.device_commit:
            raise TransportError(f"record {self.key}: not a pending device commit")
        self._done = True
        self.tensors = {}
        self.commit_target = None

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        self.tensors = {}
        self.commit_target = None
        with self.sink.pool.locked():
            self.sink.pool.free(self.head)


class ShmSource(Source):
    """Consumer side: the pool's single reader."""

    def __init__(self, config: dict[str, Any], *, copy: bool = False):
        self.name = config["name"]
        self.copy = copy
        self.checksum = str(config.get("checksum", DEFAULT_CHECKSUM))
        self.records_per_slot_hint = max(1, int(config.get("slots_per_record", 1)))
        self.pool = sp.Pool(self.name)
        self._claim_consumer()
        self.bell = sp.Doorbell(sp.consumer_bell(self.name))
        self._seen: set[str] = set()
        self._last_seq = -1
        self._pending: list[int] = []  # heads of records the device will commit (WRITING with a seq)
        self._next_liveness = 0.0
        self._dead_writers: list[str] = []

    def _claim_consumer(self) -> None:
        me, start = os.getpid(), sp.proc_start_time(os.getpid()) or 0
        with self.pool.locked():
            pid, pstart, closed = self.pool.consumer()
            if pid and pid != me and sp.alive(pid, pstart) and not closed:
                raise TransportError(f"shm pool {self.name} already has a live consumer (pid {pid})")
            self.pool.set_consumer(me, start)

    # --- delivery ------------------------------------------------------------------------------
    def _take(self) -> list[sp.SlotInfo]:
        seq = self.pool.commit_seq()
        # Nothing new: no sequence number taken since the last scan, and no pending device commit landed
        # (its state word is the only thing that changes; read without the lock, re-read under it).
        if seq == self._last_seq and not any(self.pool.state_of(h) == sp.COMMITTED for h in self._pending):
            return []
        with self.pool.locked():
            self._last_seq = self.pool.commit_seq()
            states = self.pool.state_words()  # state words only; whole entries of the slots that matter
            taken = [self.pool.slot(i) for i in np.flatnonzero(states == sp.COMMITTED).tolist()]
            self._pending = [i for i in np.flatnonzero(states == sp.WRITING).tolist() if self.pool.seq_of(i)]
            for s in taken:
                self.pool.set_slot(s.index, sp.READING, s.writer, s.span, s.seq, s.length, s.checksum)
        return sorted(taken, key=lambda s: s.seq)

    def _release(self, head: int) -> None:
        if self.pool.mm.closed:
            return
        with self.pool.locked():
            self.pool.free(head)
        for w in self.pool.active_writers():  # wake writers blocked on a full pool
            self.bell.ring(sp.writer_bell(self.name, w))

    def _to_record(self, s: sp.SlotInfo) -> Record:
        if s.key in self._seen:
            raise TransportError(f"record {s.key} was committed twice to shm pool {self.name}")
        view = self.pool.data(s.index, s.span)[: s.length]
        if sp.checksum(view, self.checksum) != s.checksum:
            raise IntegrityError(f"record {s.key}: shm payload checksum mismatch in slot {s.index}")
        tensors, meta = deserialize(view)
        if "key" in meta and str(meta["key"]) != s.key:
            raise IntegrityError(f"record {s.key}: slot holds a payload for key {meta['key']}")
        rec = to_record(tensors, meta)
        if self.copy:
            rec.token_ids, rec.hidden_states = rec.token_ids.clone(), rec.hidden_states.clone()
            rec.loss_mask = None if rec.loss_mask is None else rec.loss_mask.clone()
            rec.positions = None if rec.positions is None else rec.positions.clone()
            self._release(s.index)
        else:
            rec._release = lambda head=s.index: self._release(head)
        return rec

    def _deliver(self, taken: list[sp.SlotInfo]) -> list[Record]:
        out: list[Record] = []
        for i, s in enumerate(taken):
            try:
                out.append(self._to_record(s))
            except (RecordError, TransportError):
                # Exactly once: the bad record is dropped *loudly*; the others go back to COMMITTED so
                # the next poll hands them out (none of them was returned yet).
                with self.pool.locked():
                    self.pool.free(s.index)
                    for r in [*taken[:i], *taken[i + 1 :]]:
                        self.pool.set_slot(r.index, sp.COMMITTED, r.writer, r.span, r.seq, r.length, r.checksum)
                    self._last_seq = -1
                for r in out:
                    r._release = None
                raise
            self._seen.add(s.key)
        return out

    def _check_writers(self) -> None:
        """Raise ``PeerGone`` once for each writer that died without closing; reclaim its slots."""
        for w in range(sp.MAX_WRITERS):
            state, pid, start, name = self.pool.writer(w)
            if state != sp.W_ACTIVE or sp.alive(pid, start):
                continue
            with self.pool.locked():
                lost = [s for s in map(self.pool.slot, range(self.pool.num_slots))
                        if s.writer == w and s.state == sp.WRITING]
                if any(s.writer == w and s.state == sp.COMMITTED for s in map(self.pool.slot, range(self.pool.num_slots))):
                    continue  # deliver what it committed first
                for s in lost:
                    self.pool.free(s.index)
                self.pool.set_writer(w, sp.W_DEAD, pid, start, name)
                self._last_seq = -1  # rescan: its pending device commits are gone
            keys = ", ".join(s.key for s in lost) or "none mid-write"
            raise PeerGone(f"shm pool {self.name}: writer {name!r} (pid {pid}) died; records lost in flight: {keys}")

    def poll(self, timeout: float = 0.0) -> list[Record]:
        """Records committed since the last call, in commit order (waits up to ``timeout`` s for one)."""
        if self.pool.mm.closed:
            raise TransportError(f"shm source {self.name} is closed")
        deadline = time.monotonic() + timeout
        while True:
            taken = self._take()
            if taken:
                return self._deliver(taken)
            now = time.monotonic()
            # Peers are checked at most every _LIVENESS_EVERY s: a caller polling with timeout 0 in its
            # own loop (the Tap, between engine steps) must not pay a /proc scan per call.
            if now >= self._next_liveness:
                self._next_liveness = now + _LIVENESS_EVERY
                self._check_writers()
            if now >= deadline:
                return []
            # Sinks ring on every CPU commit, and once per batch of device commits when they are queued
            # (wake_consumer); their landing rings nobody, so while one is pending the wait is short (the
            # copy lands within a millisecond of the engine's step).
            self.bell.wait(min(_DEVICE_WAIT if self._pending else _MAX_WAIT, deadline - now))

    def free_capacity(self) -> int:
        """Records of the expected size that fit in the free slots right now."""
        return self.pool.free_slots() // self.records_per_slot_hint

    def close(self) -> None:
        """Mark the pool closed (sinks then raise ``PeerGone``), unmap it and unlink its name."""
        if not self.pool.mm.closed:
            with self.pool.locked():
                pid, start, _ = self.pool.consumer()
                self.pool.set_consumer(pid, start, closed=True)
            self.pool.close()
            self.bell.close()
        ShmTransport.cleanup({"name": self.name})


@register
class ShmTransport(Transport):
    name = "shm"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("shm transport")
        g.add_argument("--shm-slot-mb", type=int, default=DEFAULT_SLOT_BYTES >> 20,
                       help="size of one pool slot in MiB; a larger record spans several slots (default 64)")
        g.add_argument("--shm-slots", type=int, default=DEFAULT_NUM_SLOTS,
                       help="number of slots: the pool holds slots x slot size bytes, allocated up front (default 16)")
        g.add_argument("--shm-put-timeout", type=float, default=DEFAULT_PUT_TIMEOUT,
                       help="seconds a worker waits for a free slot before failing the record (default 60)")
        g.add_argument("--shm-checksum", choices=sp.CHECKSUMS, default=DEFAULT_CHECKSUM,
                       help="payload checksum verified by the consumer: none (default; the token digest is always checked), "
                            "sum64 (fast) or crc32")

    @classmethod
    def config_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"slot_bytes": args.shm_slot_mb << 20, "num_slots": args.shm_slots,
                "put_timeout": args.shm_put_timeout, "checksum": args.shm_checksum}

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Create the pool; returns the config sinks and the source need (adds ``name``)."""
        slot_bytes = sp.round_up(int(config.get("slot_bytes", DEFAULT_SLOT_BYTES)), sp.PAGE)
        num_slots = int(config.get("num_slots", DEFAULT_NUM_SLOTS))
        if num_slots < 1 or slot_bytes < sp.PAGE:
            raise ValueError(f"shm pool needs num_slots >= 1 and slot_bytes >= {sp.PAGE}, got {num_slots}, {slot_bytes}")
        config = {**config, "checksum": str(config.get("checksum", DEFAULT_CHECKSUM))}
        sp.checksum(memoryview(b""), config["checksum"])
        # The creator's pid in the name: an operator (or a test) can tell whose pool a segment is.
        name = f"layertap-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        size = sp.Pool.create(name, num_slots, slot_bytes)
        resource_tracker.register("/" + name, "shared_memory")  # unlinked by the tracker if we die
        _TRACKED.add(name)
        return {**config, "name": name, "slot_bytes": slot_bytes, "num_slots": num_slots, "pool_bytes": size}

    @classmethod
    def make_sink(cls, config: dict[str, Any], writer_id: str) -> Sink:
        return ShmSink(config, writer_id)

    @classmethod
    def make_source(cls, config: dict[str, Any], *, copy: bool = False) -> Source:
        return ShmSource(config, copy=copy)

    @classmethod
    def cleanup(cls, config: dict[str, Any]) -> None:
        """Unlink the pool name (idempotent); mappings still open stay valid until unmapped."""
        try:
            os.unlink(sp.segment_path(config["name"]))
        except FileNotFoundError:
            pass  # already unlinked (by close(), by a sink that saw us die, or by the tracker)
        if config["name"] in _TRACKED:
            _TRACKED.discard(config["name"])
            resource_tracker.unregister("/" + config["name"], "shared_memory")
