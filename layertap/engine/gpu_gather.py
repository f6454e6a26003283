"""Gathering captured rows off the GPU without stalling the forward stream. No vLLM import.

Stream discipline (the bug class peers shipped: capture indices allocated on the wrong stream):
  1. an event recorded on the *current* (forward) stream marks the rows as written; the gather stream
     waits on it, so the gather never reads a row before the forward pass wrote it;
  2. the block-index tensor is created *on the gather stream* (``torch.cuda.stream(side)`` is active when
     it is allocated), so the caching allocator ties its memory to that stream: it cannot be handed to a
     forward-stream allocation while the gather still reads it;
  3. the gather copies the rows into a private device buffer, and the forward stream waits for that
     gather (a few microseconds), not for the host copy: from then on the next forward pass may rewrite
     the rows' cache blocks, so the engine can free them in the same step (``hold_forward``);
  4. the device-to-host copies run on a third stream from the private buffer into page-locked host
     memory (queued by the thread that reserved that memory: the connector's step thread by default);
     the buffer goes back to the caching allocator tied to that stream (``record_stream``), so it is
     not reused before the copies are done;
  5. with a device commit, each record's commit word is copied after the payloads on the same stream:
     the record becomes visible to its consumer when the copy engine gets there, and no engine thread
     waits for the copy.
The index is one entry per cache block, not per token (a record's rows are a prefix of its blocks'
rows), so the step thread's work per record is a list of a few dozen ints.

The lean record path (``record_writer``, the default with device commits) keeps rules 1-3 by running the
gather on the forward stream itself: it reads after the rows' writes and before any later forward work by
stream order, its index comes from a page-locked ring into a device buffer that only that stream touches
(``IndexUpload``), and no event or side stream is needed. Rules 4-5 hold as above, the copies queued with
``RawCopies`` (raw ``cudaMemcpyAsync``) after the copy stream waited for an event behind the gather.
"""

from __future__ import annotations

from typing import Any

import torch

from layertap.engine.cache_view import ViewGeometry, gather_blocks


def gather_on_device(view: torch.Tensor, geo: ViewGeometry, block_lists: list[list[int]], side: "torch.cuda.Stream",
                     *, hold_forward: bool = True, index_on_side_stream: bool = True, delay_cycles: int = 0):
    """Queue the gather of every row of these view blocks (one list per record, ``view_blocks_for``) into
    a private device buffer on ``side``: one event, one index upload, one gather kernel for the whole
    step. Returns (rows ``[blocks * view_block_size, n_planes, hidden]``, the gather's completion event,
    keep-alive); record i's rows start at ``view_block_size * sum(len(block_lists[j]) for j < i)``.

    ``hold_forward``: the current (forward) stream waits for the gather kernel, so the rows' cache blocks may
    be reused by any work queued after this call (the connector then releases them at once); ``False``
    leaves the forward stream free and the caller must keep the blocks until the returned event.
    ``index_on_side_stream=False`` and ``delay_cycles`` exist only so a test can show what goes wrong with
    the index tensor on the wrong stream (the connector never passes them).
    """
    # Every torch call here costs the engine's step 3-35 us on the H200 host (benchmarks/record_path_cost.py
    # --breakdown, RESULTS 2026-12-03): one stream context for the upload and the gather, the index made
    # page-locked in one call.
    forward = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(forward)  # everything queued so far, including the rows' writes
    side.wait_event(ready)
    host_idx = torch.tensor([b for blocks in block_lists for b in blocks], dtype=torch.int64, pin_memory=True)
    if not index_on_side_stream:
        dev_idx = host_idx.to(view.device, non_blocking=True)  # WRONG: allocated on the forward stream
        side.wait_stream(forward)
    with torch.cuda.stream(side):
        if index_on_side_stream:
            dev_idx = host_idx.to(view.device, non_blocking=True)
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)
        rows = gather_blocks(view, geo, dev_idx)  # a private copy: the cache blocks are no longer read
    gathered = torch.cuda.Event()
    gathered.record(side)
    if hold_forward:
        forward.wait_event(gathered)
    # The pinned source of the upload must outlive it; the caller holds it with the rows.
    return rows, gathered, host_idx


def copy_to_host(rows: torch.Tensor, spans: list[tuple[int, int]], dsts: list[torch.Tensor | None],
                 copy_stream: "torch.cuda.Stream", after: "torch.cuda.Event", *, blocking: bool = True,
                 commits: list[torch.Tensor] | None = None, commit_word: torch.Tensor | None = None):
    """Queue the device-to-host copies of ``rows[start:start + n]`` for each (start, n) in ``spans`` on
    ``copy_stream``, after ``after`` (the gather). ``dsts[i]``: page-locked host memory to land record i in
    (e.g. a registered shared-memory slot, so the record needs no further copy); ``None``: a fresh pinned
    buffer. Returns (host rows per record, completion event); ``rows`` must stay alive until it completes
    (or be handed to the caching allocator with ``record_stream(copy_stream)``).
    Any thread may call this. ``blocking``: a thread that waits on the event sleeps
    (``cudaEventBlockingSync``) instead of spinning, so the wait keeps no CPU busy in the engine's
    process.

    ``commits`` (device commit): one page-locked host word per record; after *every* payload copy is
    queued, ``commit_word`` (a device tensor of the same shape) is copied into each, on the same stream, so
    each lands after its payload (stream order) and no CPU thread has to wait for the copies to commit the
    records. The commit words are queued last so that an error while queueing payloads leaves no record
    half-committed: the caller may still abort them all."""
    copy_stream.wait_event(after)
    hosts = []
    with torch.cuda.stream(copy_stream):
        for (a, n), dst in zip(spans, dsts):
            host = torch.empty((n, *rows.shape[1:]), dtype=rows.dtype, pin_memory=True) if dst is None else dst
            host.copy_(rows[a:a + n], non_blocking=True)
            hosts.append(host)
        for target in commits or ():
            target.copy_(commit_word, non_blocking=True)
    done = torch.cuda.Event(blocking=blocking)
    done.record(copy_stream)
    return hosts, done


def spans_of(block_lists: list[list[int]], counts: list[int], view_block_size: int) -> list[tuple[int, int]]:
    """(first row, rows) of each record in a ``gather_on_device`` result."""
    spans, a = [], 0
    for blocks, n in zip(block_lists, counts):
        if n > len(blocks) * view_block_size:
            raise ValueError(f"{n} rows do not fit {len(blocks)} blocks of {view_block_size}")
        spans.append((a, n))
        a += len(blocks) * view_block_size
    return spans


def gather_many_to_host(view: torch.Tensor, geo: ViewGeometry, block_lists: list[list[int]], counts: list[int],
                        side: "torch.cuda.Stream", dsts: list[torch.Tensor | None], *,
                        copy_stream: "torch.cuda.Stream | None" = None, **options: Any):
    """``gather_on_device`` then ``copy_to_host`` (on ``copy_stream``, default ``side``): the first
    ``counts[i]`` rows of record i's blocks land in host memory. The one-call form the stream tests use;
    the connector calls the two halves itself, reserving transport memory in between. Returns (host rows per record, completion
    event of the host copies, keep-alive to hold until then)."""
    rows, gathered, keep = gather_on_device(view, geo, block_lists, side, **options)
    spans = spans_of(block_lists, counts, geo.view_block_size)
    hosts, done = copy_to_host(rows, spans, dsts, copy_stream or side, gathered)
    return hosts, done, (keep, rows)


class RawCopies:
    """``cudaMemcpyAsync`` called straight through the CUDA runtime this process already loaded (the one
    torch uses, found in ``/proc/self/maps``), with raw addresses: ~2 us a call from Python where a torch
    ``copy_`` between views costs 7-33 us on the H200 host (``benchmarks/record_path_cost.py --breakdown``).
    The lean record path (``record_writer``) queues its payload and commit-word copies with it; lifetimes
    are the caller's (the source held by ``record_stream`` on the copy stream, the destination page-locked
    transport memory). Every call's status is checked."""

    H2D, D2H = 1, 2

    # cudaEventCreateWithFlags flags; cudaErrorNotReady: an event query's "not yet"
    EVENT_BLOCKING_SYNC, EVENT_DISABLE_TIMING, NOT_READY = 0x01, 0x02, 600

    def __init__(self, lib: Any):
        import ctypes

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
            return fn

        vp = ctypes.c_void_p
        self._fn = bind("cudaMemcpyAsync", vp, vp, ctypes.c_size_t, ctypes.c_int, vp)
        self._err = lib.cudaGetErrorString
        self._err.argtypes = [ctypes.c_int]
        self._err.restype = ctypes.c_char_p
        # Events through the same runtime (a torch Event's create, record, query or wait costs 5-15 us of
        # Python and dispatch on the GPU hosts' step thread; these ~1-2 us; benchmarks/step_profile.py)
        self._ev_create = bind("cudaEventCreateWithFlags", ctypes.POINTER(vp), ctypes.c_uint)
        self._ev_record = bind("cudaEventRecord", vp, vp)
        self._ev_query = bind("cudaEventQuery", vp)
        self._ev_sync = bind("cudaEventSynchronize", vp)
        self._ev_destroy = bind("cudaEventDestroy", vp)
        self._wait = bind("cudaStreamWaitEvent", vp, vp, ctypes.c_uint)
        self._last = bind("cudaGetLastError")
        self._vp = vp

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: cudaError {code} ({self._err(code).decode(errors='replace')})")

    def event(self, blocking: bool = False) -> "RawEvent":
        """A CUDA event without timing (``blocking``: a host wait on it sleeps instead of spinning)."""
        h = self._vp()
        self._check(self._ev_create(h, self.EVENT_DISABLE_TIMING | (self.EVENT_BLOCKING_SYNC if blocking else 0)),
                    "cudaEventCreateWithFlags")
        return RawEvent(self, h.value)

    def wait_event(self, stream: int, event: "RawEvent") -> None:
        """Work queued on ``stream`` from now on waits for ``event``'s last record."""
        self._check(self._wait(stream, event.handle, 0), "cudaStreamWaitEvent")

    @classmethod
    def load(cls) -> "RawCopies | None":
        """The loaded CUDA runtime's copy entry point, or ``None`` (no ``libcudart`` mapped in this process:
        torch linked it statically, or CUDA is not initialized); the caller then copies through torch."""
        import ctypes

        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart.so" in line and "/" in line}
        except OSError:
            return None
        for path in sorted(paths):
            try:
                rt = cls(ctypes.CDLL(path))
            except (OSError, AttributeError):
                continue
            rt.path = path  # the record process loads the same library (record_proc)
            return rt
        return None

    def copy(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        code = self._fn(dst, src, nbytes, kind, stream)
        if code != 0:
            raise RuntimeError(f"cudaMemcpyAsync of {nbytes} bytes failed: cudaError {code} "
                               f"({self._err(code).decode(errors='replace')})")


class RawEvent:
    """A CUDA event made by ``RawCopies.event``, with torch's ``Event`` methods the record path uses
    (``record`` takes a raw stream handle). Destroyed with the object."""

    __slots__ = ("rt", "handle")

    def __init__(self, rt: RawCopies, handle: int):
        self.rt, self.handle = rt, handle

    def record(self, stream: int) -> None:
        self.rt._check(self.rt._ev_record(self.handle, stream), "cudaEventRecord")

    def query(self) -> bool:
        code = self.rt._ev_query(self.handle)
        if code == RawCopies.NOT_READY:
            self.rt._last()  # "not ready" is left as the thread's last error: clear it, as torch's query does
            return False
        self.rt._check(code, "cudaEventQuery")
        return True

    def synchronize(self) -> None:
        self.rt._check(self.rt._ev_sync(self.handle), "cudaEventSynchronize")

    def __del__(self) -> None:
        try:
            self.rt._ev_destroy(self.handle)
        except Exception:  # interpreter shutdown: the runtime may be gone
            pass


class IndexUpload:
    """A step's block index on the device without a page-locked allocation per step: a ring of page-locked
    host rows, each reused once its upload ran (an event per row), copied on the *current* stream into one
    device buffer that the same stream's gather then reads. Stream order keeps the next step's upload from
    overwriting the buffer before this step's gather ran (rule 2's hazard cannot arise: the buffer is never
    freed, and only the current stream uses it)."""

    def __init__(self, device: torch.device, copies: RawCopies, slots: int = 16, capacity: int = 4096):
        self.device, self.copies, self.slots = device, copies, slots
        self._alloc(capacity)
        self.i = 0

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.empty((self.slots, capacity), dtype=torch.int64, pin_memory=True)
        self.rows = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.host_ptr, self.dev_ptr = self.host.data_ptr(), self.dev.data_ptr()
        self.events = [self.copies.event() for _ in range(self.slots)]
        self.used = [False] * self.slots
        self.heads: dict[int, torch.Tensor] = {}  # self.dev[:n] by n, made once each

    def __call__(self, block_lists: list[list[int]], stream: int | None = None) -> torch.Tensor:
        """The blocks of ``block_lists`` in one device index; uploaded on ``stream`` (a raw handle; default:
        the current stream), which must be the stream that then reads the index."""
        n = sum(map(len, block_lists))
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        if n > self.capacity:  # the old buffers go back to their allocators; the current stream's order holds
            torch.cuda.current_stream().synchronize()
            self._alloc(max(n, 2 * self.capacity))
            self.i = 0
        i = self.i
        self.i = (i + 1) % self.slots
        if self.used[i]:
            self.events[i].synchronize()  # its upload ran steps ago: returns at once unless the GPU is far behind
        row = self.rows[i]
        pos = 0
        for blocks in block_lists:
            row[pos:pos + len(blocks)] = blocks
            pos += len(blocks)
        self.copies.copy(self.dev_ptr, self.host_ptr + 8 * self.capacity * i, 8 * n, RawCopies.H2D, stream)
        self.events[i].record(stream)
        self.used[i] = True
        head = self.heads.get(n)
        if head is None:
            head = self.heads[n] = self.dev[:n]
        return head


def register_host(region: torch.Tensor) -> str | None:
    """Page-lock an existing host buffer (e.g. a shared-memory pool) for direct device-to-host copies.
    Returns ``None`` on success, else the driver's error (the caller then stages through pinned memory)."""
    err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel() * region.element_size(), 0)
    code = int(getattr(err, "value", err))
    if code != 0:
        return f"cudaHostRegister failed with cudaError {code} ({err})"
    if not region[:1].is_pinned():
        torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
        return "memory registered but torch does not see it as pinned"
    return None


def unregister_host(region: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
