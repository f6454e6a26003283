"""The shared-memory pool behind the ``shm`` transport: layout, locking, slot life cycle, liveness.

One POSIX shared-memory segment (``/dev/shm/<name>``), created once by the consumer and reused for
every record (writing into fresh shared memory is an order of magnitude slower than into reused pages):

    [0, 256)         header: magic, version, closed flag, slot geometry, consumer pid + start time, commit seq
    [256, 8192)      writer table: one entry per sink (pid, start time, name, state)
    [8192, data)     slot table: one entry per slot (state, writer, span, key, seq, length, checksum)
    [data, end)      ``num_slots`` slots of ``slot_bytes``; a record spans one or more contiguous slots

Slot life cycle (every transition under the pool lock, but one)::

    FREE -> WRITING (sink claims; key recorded) -> COMMITTED (payload + checksum written) ->
    READING (consumer took it) -> FREE (consumer released it)

The one exception is a *device commit* (``claim(..., device_length=n)``): the sink takes the record's
sequence number and length when it claims, and the GPU itself turns WRITING into COMMITTED, by copying the
4-byte state word into the slot table right after the payload, on the same CUDA stream. Stream order puts
the word after the payload, so a record never looks complete before it is; no CPU thread of the engine
waits for the copy. A slot WRITING with a sequence number is such a pending record: the consumer watches
its state word (``state_of``).

The lock is a POSIX record lock (``fcntl.lockf``) on byte 0 of the segment: the kernel drops it when its
holder dies, so a ``kill -9`` never leaves the pool locked. Liveness of a peer is its pid plus its start
time from ``/proc`` (pid reuse is caught; a zombie counts as dead), so all peers must share one pid
namespace, which holds for one machine.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import select
import socket
import struct
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from layertap.transport.base import TransportError

MAGIC = b"LTAPSHM1"
VERSION = 1
PAGE = 4096
SHM_DIR = "/dev/shm"

_HDR = struct.Struct("<8sIIQQQQQQ")  # magic, version, closed, num_slots, slot_bytes, data_off, cpid, cstart, seq
_OFF_CLOSED, _OFF_CPID, _OFF_CSTART, _OFF_SEQ = 12, 40, 48, 56
_WRITERS_AT, _WRITER_SIZE, MAX_WRITERS = 256, 128, 60
_WRITER = struct.Struct("<IIQQ96s")  # state, pad, pid, start time, name
_SLOTS_AT, _SLOT_SIZE = 8192, 256
_SLOT = struct.Struct("<IIIIQQQ")  # state, writer, span, key length, seq, length, checksum
MAX_KEY_BYTES = _SLOT_SIZE - _SLOT.size

FREE, WRITING, COMMITTED, READING, CONT = 0, 1, 2, 3, 4
W_EMPTY, W_ACTIVE, W_CLOSED, W_DEAD = 0, 1, 2, 3
CHECKSUMS = ("crc32", "sum64", "none")


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def data_offset(num_slots: int) -> int:
    return round_up(_SLOTS_AT + num_slots * _SLOT_SIZE, PAGE)


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def proc_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or ``None`` if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] in (b"Z", b"X"):  # zombie / dead: exited, not yet reaped
        return None
    return int(fields[19])  # field 22 of stat; fields[] starts at field 3


def alive(pid: int, start: int) -> bool:
    return pid > 0 and proc_start_time(pid) == start


def checksum(view: memoryview, kind: str) -> int:
    """Payload checksum. ``crc32`` (default) catches any corruption at ~7 GB/s per core; ``sum64`` (a
    wrapping sum of 64-bit words, plus the length) runs near memory bandwidth and still catches stale or
    overwritten slots; ``none`` leaves only the header parse and the token-id digest."""
    if kind == "crc32":
        return zlib.crc32(view) & 0xFFFFFFFF
    if kind == "sum64":
        n8 = len(view) // 8 * 8
        words = np.frombuffer(view[:n8], dtype="<u8")
        tail = int.from_bytes(bytes(view[n8:]), "little")
        return (int(words.sum(dtype=np.uint64)) + tail + len(view)) & 0xFFFFFFFFFFFFFFFF
    if kind == "none":
        return 0
    raise ValueError(f"checksum must be one of {CHECKSUMS}, got {kind!r}")


class Doorbell:
    """Wake-ups between the processes of one pool: an abstract-namespace unix datagram socket.

    No file is created (nothing to leak: the kernel frees the name when its owner exits) and it is not
    a network listener. A ring is only a hint: waiters still re-check the pool state and wait at most
    ``timeout``, so a lost ring (peer not bound yet, queue full) costs latency, never correctness.
    """

    def __init__(self, name: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + name)
        self.sock.setblocking(False)
        self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._out.setblocking(False)

    def wait(self, timeout: float) -> None:
        """Block until rung or ``timeout`` s pass; swallow all pending rings."""
        if select.select([self.sock], [], [], max(0.0, timeout))[0]:
            try:
                while self.sock.recv(64):
                    pass
            except BlockingIOError:
                pass  # drained

    def ring(self, name: str) -> None:
        try:
            self._out.sendto(b"!", "\0" + name)
        except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
            pass  # the peer has a ring queued already, or is not waiting (see the class docstring)

    def close(self) -> None:
        self.sock.close()
        self._out.close()


def consumer_bell(pool: str) -> str:
    return f"{pool}.c"


def writer_bell(pool: str, writer: int) -> str:
    return f"{pool}.w{writer}"


@dataclass(slots=True)
class SlotInfo:
    index: int
    state: int
    writer: int
    span: int
    seq: int
    length: int
    checksum: int
    key: str


class Pool:
    """A mapping of the pool segment. ``create`` makes one (consumer side); ``Pool(name)`` maps it."""

    def __init__(self, name: str):
        self.name = name
        try:
            self._fd = os.open(segment_path(name), os.O_RDWR)
        except FileNotFoundError as e:
            raise TransportError(f"shm pool {name} does not exist (consumer gone or never prepared)") from e
        size = os.fstat(self._fd).st_size
        # MAP_POPULATE: fault every page in now, so the first record does not pay for page-table set-up.
        self.mm = mmap.mmap(self._fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        magic, version, _, self.num_slots, self.slot_bytes, self.data_off, *_ = _HDR.unpack_from(self.mm, 0)
        if magic != MAGIC or version != VERSION:
            self.close()
            raise TransportError(f"/dev/shm/{name} is not a layertap pool of version {VERSION}")
        self._tlock = threading.Lock()  # record locks are per process: threads need their own lock
        # How this process fared on the pool lock: acquisitions, those that found it held by another
        # process, and the seconds spent waiting for it (``lock_stats``; the engine's worker logs them).
        self.lock_calls = self.lock_contended = 0
        self.lock_wait_s = self.lock_wait_max_s = 0.0
        self._cursor = 0  # where the next claim starts looking (see ``claim``)

    @staticmethod
    def create(name: str, num_slots: int, slot_bytes: int) -> int:
        """Create and pre-allocate the segment (raises ``TransportError`` if /dev/shm lacks room)."""
        size = data_offset(num_slots) + num_slots * slot_bytes
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve tmpfs pages now: no SIGBUS later, no first-touch cost
            hdr = _HDR.pack(MAGIC, VERSION, 0, num_slots, slot_bytes, data_offset(num_slots), 0, 0, 0)
            os.pwrite(fd, hdr, 0)
        except OSError as e:
            os.close(fd)
            os.unlink(segment_path(name))
            raise TransportError(f"cannot allocate a {size}-byte shm pool {name} in {SHM_DIR}: {e}") from e
        os.close(fd)
        return size

    LOCK_TIMEOUT = 30.0
    """Seconds to wait for the pool lock. Every holder keeps it for microseconds; a peer that keeps it this
    long is stopped (SIGSTOP, a debugger) or hung, and waiting on would hang every other peer with it."""

    @contextmanager
    def locked(self) -> Iterator[None]:
        with self._tlock:
            self._acquire()
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)

    def _try_lock(self) -> bool:
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
            return True
        except (BlockingIOError, PermissionError):
            return False

    def _acquire(self) -> None:
        self.lock_calls += 1
        if self._try_lock():  # usually free at the first try
            return
        t0 = time.monotonic()
        self.lock_contended += 1
        deadline, pause = t0 + self.LOCK_TIMEOUT, 0.0001
        try:
            while True:
                if time.monotonic() >= deadline:
                    raise TransportError(
                        f"shm pool {self.name}: its lock was held by another process for {self.LOCK_TIMEOUT:.0f} s "
                        f"(pid {self._lock_holder()}; stopped or hung?)")
                time.sleep(pause)
                pause = min(pause * 2, 0.005)
                if self._try_lock():
                    return
        finally:
            waited = time.monotonic() - t0
            self.lock_wait_s += waited
            self.lock_wait_max_s = max(self.lock_wait_max_s, waited)

    def lock_stats(self) -> dict[str, float]:
        """This process's acquisitions of the pool lock, how many found it held by another process, and the
        time waited (total and longest, ms)."""
        return {"acquired": self.lock_calls, "contended": self.lock_contended,
                "waited_ms": 1e3 * self.lock_wait_s, "longest_wait_ms": 1e3 * self.lock_wait_max_s}

    def _lock_holder(self) -> int | None:
        """The pid holding the pool lock (F_GETLK), or ``None``."""
        try:
            fl = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 1, 0)
            got = struct.unpack("hhqqi", fcntl.fcntl(self._fd, fcntl.F_GETLK, fl))
            return got[4] if got[0] != fcntl.F_UNLCK else None
        except OSError:
            return None

    # --- header -------------------------------------------------------------------------------
    def consumer(self) -> tuple[int, int, bool]:
        closed = struct.unpack_from("<I", self.mm, _OFF_CLOSED)[0]
        pid, start = struct.unpack_from("<QQ", self.mm, _OFF_CPID)
        return pid, start, bool(closed)

    def set_consumer(self, pid: int, start: int, closed: bool = False) -> None:
        struct.pack_into("<I", self.mm, _OFF_CLOSED, int(closed))
        struct.pack_into("<QQ", self.mm, _OFF_CPID, pid, start)

    def commit_seq(self) -> int:
        return struct.unpack_from("<Q", self.mm, _OFF_SEQ)[0]

    # --- writers ------------------------------------------------------------------------------
    def writer(self, i: int) -> tuple[int, int, int, str]:
        state, _, pid, start, name = _WRITER.unpack_from(self.mm, _WRITERS_AT + i * _WRITER_SIZE)
        return state, pid, start, name.rstrip(b"\0").decode(errors="replace")

    def set_writer(self, i: int, state: int, pid: int, start: int, name: str) -> None:
        _WRITER.pack_into(self.mm, _WRITERS_AT + i * _WRITER_SIZE, state, 0, pid, start, name.encode()[:96])

    def register_writer(self, name: str) -> int:
        pid = os.getpid()
        start = proc_start_time(pid) or 0
        with self.locked():
            for i in range(MAX_WRITERS):
                if self.writer(i)[0] == W_EMPTY:
                    self.set_writer(i, W_ACTIVE, pid, start, name)
                    return i
        raise TransportError(f"shm pool {self.name} has no free writer entry (max {MAX_WRITERS} writers)")

    # --- slots (callers hold the lock for anything that changes state) --------------------------
    def slot(self, i: int) -> SlotInfo:
        off = _SLOTS_AT + i * _SLOT_SIZE
        state, writer, span, klen, seq, length, cks = _SLOT.unpack_from(self.mm, off)
        key = bytes(self.mm[off + _SLOT.size : off + _SLOT.size + klen]).decode()
        return SlotInfo(i, state, writer, span, seq, length, cks, key)

    def set_slot(self, i: int, state: int, writer: int = 0, span: int = 0, seq: int = 0, length: int = 0,
                 cks: int = 0, key: bytes | None = None) -> None:
        off = _SLOTS_AT + i * _SLOT_SIZE
        if key is not None:
            self.mm[off + _SLOT.size : off + _SLOT.size + len(key)] = key
        klen = len(key) if key is not None else _SLOT.unpack_from(self.mm, off)[3]
        _SLOT.pack_into(self.mm, off, state, writer, span, klen, seq, length, cks)

    def state_words(self) -> np.ndarray:
        """Every slot's state word, read in one strided copy (a few microseconds for hundreds of slots,
        where a word-by-word read cost ~0.2 ms: the Tap asks for the free count before every admission)."""
        stride = _SLOT_SIZE // 4
        return np.frombuffer(self.mm, dtype="<u4", count=self.num_slots * stride, offset=_SLOTS_AT)[::stride].copy()

    def active_writers(self) -> list[int]:
        """Indices of the writer entries in state ``W_ACTIVE`` (one strided read of the table)."""
        stride = _WRITER_SIZE // 4
        words = np.frombuffer(self.mm, dtype="<u4", count=MAX_WRITERS * stride, offset=_WRITERS_AT)[::stride]
        return np.flatnonzero(words == W_ACTIVE).tolist()

    def seq_of(self, i: int) -> int:
        return struct.unpack_from("<Q", self.mm, _SLOTS_AT + i * _SLOT_SIZE + 16)[0]

    def free_slots(self) -> int:
        return int(np.count_nonzero(self.state_words() == FREE))

    def state_offset(self, head: int) -> int:
        """Byte offset of a slot's state word in the mapping (where a device commit writes)."""
        return _SLOTS_AT + head * _SLOT_SIZE

    def state_of(self, head: int) -> int:
        return struct.unpack_from("<I", self.mm, _SLOTS_AT + head * _SLOT_SIZE)[0]

    def claim(self, span: int, writer: int, key: bytes, device_length: int | None = None) -> int | None:
        """Mark the first run of ``span`` free slots as being written; returns its head or ``None``.
        ``device_length``: the record's length, for a device commit (module docstring): its sequence number
        is taken now, so the consumer knows the slot will turn COMMITTED without a CPU commit."""
        with self.locked():
            run = 0
            # First fit, starting where this process's last claim ended (the pool fills and drains as a
            # ring, so the slots there are the likeliest free ones: a claim reads a few state words, not
            # every busy slot's); a run never wraps past the last slot.
            n, start = self.num_slots, self._cursor % self.num_slots
            for k in range(n if start == 0 else n + span - 1):  # every possible head once
                i = (start + k) % n
                if i == 0:
                    run = 0
                s = struct.unpack_from("<I", self.mm, _SLOTS_AT + i * _SLOT_SIZE)[0]
                run = run + 1 if s == FREE else 0
                if run == span:
                    head = i - span + 1
                    self._cursor = i + 1
                    for j in range(head + 1, head + span):
                        self.set_slot(j, CONT, writer)
                    if device_length is None:
                        self.set_slot(head, WRITING, writer, span, key=key)
                    else:
                        seq = self.commit_seq() + 1
                        struct.pack_into("<Q", self.mm, _OFF_SEQ, seq)  # wakes the consumer's full scan
                        self.set_slot(head, WRITING, writer, span, seq, device_length, 0, key=key)
                    return head
        return None

    def commit(self, head: int, length: int, cks: int) -> None:
        with self.locked():
            seq = self.commit_seq() + 1
            struct.pack_into("<Q", self.mm, _OFF_SEQ, seq)
            s = self.slot(head)
            self.set_slot(head, COMMITTED, s.writer, s.span, seq, length, cks)

    def free(self, head: int) -> None:
        """Return a record's slots to the pool (caller holds the lock)."""
        span = max(1, self.slot(head).span)
        for j in range(head, head + span):
            self.set_slot(j, FREE)

    def data_offset(self, head: int) -> int:
        """Byte offset of a slot's data in the mapping."""
        return self.data_off + head * self.slot_bytes

    def data(self, head: int, span: int) -> memoryview:
        start = self.data_offset(head)
        return memoryview(self.mm)[start : start + span * self.slot_bytes]

    def close(self) -> None:
        """Unmap. If a caller still holds tensor views, the mapping stays until they are collected."""
        try:
            self.mm.close()
        except BufferError:
            pass  # exported views (live tensors) keep the pages mapped; the kernel frees them with the views
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
