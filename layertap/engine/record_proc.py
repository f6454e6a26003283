"""The record process: a finished request's rows leave the engine's step thread as soon as they are gathered.

On CUDA the engine's one thread launches every kernel, and on a small model it bounds the step: every
microsecond of Python there costs throughput (``benchmarks/step_profile.py``, RESULTS 2026-12-06: the record
path was ~0.42 of capture's ~0.73 ms a request on a ~10 ms step). With the record process (connector option
``offload``, the default on the lean path) the step thread only

  1. gathers the records' rows on the forward stream into a *staging ring*, device memory that this module
     allocated and shared with the record process through CUDA IPC (the gather reads the capture layer in
     stream order before the next forward can rewrite its blocks, so the blocks are released in the same
     step, as on the in-process lean path: gpu_gather rules 1-3);
  2. records one of a few *IPC events* on the forward stream behind that gather;
  3. writes a small descriptor (the ring position, the event, each record's key, row span, token ids and
     manifest fields) into a pipe.

The record process (``python -m layertap.engine.record_proc``, one per writing worker, started by it) opened
the ring and the events; for each descriptor its own stream waits on the event, it converts and hashes each
record's token ids (``records.ids_and_digest``: the scheduler leaves that to the record's writer), reserves the
records' slots in the shm pool, writes their headers and token ids, copies the rows from the ring straight into the
page-locked slots, waits for the copies and commits. Then it advances the ring's *freed* position in a small
shared control block, which is how the engine knows the ring space is reusable. Records become visible
only when committed after their copies landed, as before; a record process that dies leaves its claimed
slots to the pool's dead-writer recovery (the consumer is told which keys were lost).

Back-pressure: a full ring (the record process behind: the pool full, or the copies slow) makes the step
wait for ring space, up to ``wait_timeout`` s, then fail by name; a group larger than the whole ring takes
the in-process lean path. The engine raises on its next step when the record process reported an error,
and on a write to its pipe once it is gone; the record process exits when the engine's end of the pipe
closes (the engine ended, or was killed).

The same protocol runs with host memory in place of the device (``staging="host"``: a shared-memory file
as the ring, no events, ``memmove`` copies): the CPU tests drive the real process that way; the CUDA path is
tested on the GPU (tests/gpu/test_lean_path.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import time
import uuid
from typing import Any

import numpy as np
import torch

from layertap.records import MetaTemplate, ids_and_digest, token_bytes
from layertap.transport.base import TransportFull, get_transport

log = logging.getLogger("vllm.layertap")

# the control block: int64 words
FREED, READY, ERROR = 0, 1, 2
CTRL_WORDS = 8
ALIGN = 4096  # ring positions start at multiples of this
PIPE_BYTES = 1 << 20
# What the record process does with a record's rows: "copy" (what records need); two benchmark aids that
# leave the rows unwritten (records carry whatever the slot held): "skip" (the process still waits on the
# gather's event on its stream, as for a copy), "nogpu" (no CUDA call at all: descriptors in, commits out).
# Beside "copy" they split the record process's cost to the engine into its copies, its GPU work, its CPU work.
ROW_MODES = ("copy", "skip", "nogpu")


def _map_ctrl(path: str) -> np.ndarray:
    """The control block's words: a plain array over a shared mapping (``np.memmap`` indexing costs more, and
    the step thread reads a word every group)."""
    import mmap

    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 8 * CTRL_WORDS)
    return np.frombuffer(mm, dtype=np.int64)


class RecordProcessError(RuntimeError):
    """The record process could not start, reported an error, died, or stopped making progress."""


# ---------------------------------------------------------------------------------------------------------
# the CUDA runtime's IPC calls (ctypes, through the libcudart the engine's torch loaded)
# ---------------------------------------------------------------------------------------------------------

class _Handle(ctypes.Structure):  # cudaIpcMemHandle_t and cudaIpcEventHandle_t: 64 opaque bytes
    _fields_ = [("reserved", ctypes.c_char * 64)]


class IpcRuntime:
    """The few CUDA runtime calls the record process and its engine side make beyond ``RawCopies``."""

    EVENT_INTERPROCESS = 0x04
    IPC_LAZY_PEER_ACCESS = 0x01
    SCHEDULE_BLOCKING_SYNC = 0x04
    STREAM_NON_BLOCKING = 0x01

    def __init__(self, path: str):
        from layertap.engine.gpu_gather import RawCopies

        self.path = path
        lib = ctypes.CDLL(path)
        self.rc = RawCopies(lib)
        vp, c_int, c_uint, c_size = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t

        def bind(name: str, *argtypes: Any) -> Any:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = list(argtypes), c_int
            return fn

        self._malloc = bind("cudaMalloc", ctypes.POINTER(vp), c_size)
        self._free = bind("cudaFree", vp)
        self._mem_handle = bind("cudaIpcGetMemHandle", ctypes.POINTER(_Handle), vp)
        self._open_mem = bind("cudaIpcOpenMemHandle", ctypes.POINTER(vp), _Handle, c_uint)
        self._close_mem = bind("cudaIpcCloseMemHandle", vp)
        self._ev_handle = bind("cudaIpcGetEventHandle", ctypes.POINTER(_Handle), vp)
        self._open_ev = bind("cudaIpcOpenEventHandle", ctypes.POINTER(vp), _Handle)
        self._set_device = bind("cudaSetDevice", c_int)
        self._set_flags = bind("cudaSetDeviceFlags", c_uint)
        self._stream = bind("cudaStreamCreateWithFlags", ctypes.POINTER(vp), c_uint)
        self._host_register = bind("cudaHostRegister", vp, c_size, c_uint)
        self._host_unregister = bind("cudaHostUnregister", vp)

    def check(self, code: int, what: str) -> None:
        self.rc._check(code, what)

    def malloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self.check(self._malloc(ctypes.byref(p), nbytes), f"cudaMalloc of {nbytes} bytes")
        return int(p.value)

    def free(self, ptr: int) -> None:
        self.check(self._free(ptr), "cudaFree")

    def mem_handle(self, ptr: int) -> bytes:
        h = _Handle()
        self.check(self._mem_handle(ctypes.byref(h), ptr), "cudaIpcGetMemHandle")
        return bytes(h)  # all 64 bytes (the field itself reads as a C string: cut at the first NUL)

    def open_mem(self, handle: bytes) -> int:
        p = ctypes.c_void_p()
        self.check(self._open_mem(ctypes.byref(p), _Handle.from_buffer_copy(handle),
                                   self.IPC_LAZY_PEER_ACCESS), "cudaIpcOpenMemHandle")
        return int(p.value)

    def close_mem(self, ptr: int) -> None:
        self.check(self._close_mem(ptr), "cudaIpcCloseMemHandle")

    def ipc_event(self) -> tuple[Any, bytes]:
        """An event another process can wait on (interprocess events take no timing), and its handle."""
        from layertap.engine.gpu_gather import RawCopies, RawEvent

        h = ctypes.c_void_p()
        self.check(self.rc._ev_create(h, RawCopies.EVENT_DISABLE_TIMING | self.EVENT_INTERPROCESS),
                   "cudaEventCreateWithFlags(interprocess)")
        ev = RawEvent(self.rc, h.value)
        eh = _Handle()
        self.check(self._ev_handle(ctypes.byref(eh), ev.handle), "cudaIpcGetEventHandle")
        return ev, bytes(eh)

    def open_event(self, handle: bytes) -> Any:
        from layertap.engine.gpu_gather import RawEvent

        h = ctypes.c_void_p()
        self.check(self._open_ev(ctypes.byref(h), _Handle.from_buffer_copy(handle)), "cudaIpcOpenEventHandle")
        return RawEvent(self.rc, h.value)

    def set_device(self, index: int) -> None:
        # before the context exists: a host wait sleeps instead of spinning a core (ignored once it exists)
        self._set_flags(self.SCHEDULE_BLOCKING_SYNC)
        self.rc._last()
        self.check(self._set_device(index), f"cudaSetDevice({index})")

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self.check(self._stream(ctypes.byref(s), self.STREAM_NON_BLOCKING), "cudaStreamCreateWithFlags")
        return int(s.value)

    def host_register(self, ptr: int, nbytes: int) -> None:
        self.check(self._host_register(ptr, nbytes, 0), "cudaHostRegister")

    def host_unregister(self, ptr: int) -> None:
        self._host_unregister(ptr)


# ---------------------------------------------------------------------------------------------------------
# the engine's side
# ---------------------------------------------------------------------------------------------------------

def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


class RecordProcess:
    """The engine side: the staging ring, the events, the pipe, the control block; starts the process.

    ``staging``: "cuda" (device ring shared through CUDA IPC; ``rt`` an ``IpcRuntime``, ``device`` its
    index) or "host" (a shared-memory file: the protocol without a device, for tests)."""

    def __init__(self, *, transport_cfg: dict[str, Any], run_meta: dict[str, Any], dtype_name: str, n_planes: int,
                 hidden: int, row_bytes: int, ring_bytes: int, staging: str = "cuda", rt: IpcRuntime | None = None,
                 device: int = 0, n_events: int = 16, start_timeout: float = 120.0, wait_timeout: float = 60.0,
                 copy_chunk: int = 0, rows: str = "copy"):
        if rows not in ROW_MODES:
            raise ValueError(f"rows={rows!r}: expected one of {ROW_MODES}")
        self.size = ring_bytes - ring_bytes % ALIGN
        self.staging = staging
        self.wait_timeout = wait_timeout
        self.head = 0  # next free ring position (monotonic bytes; the ring offset is head % size)
        self.sent = 0
        self._shared_sent: Any = None
        self.waits = 0
        self.proc: subprocess.Popen | None = None
        self.fd = -1
        self.rt = rt
        self.ptr = 0
        self.ring_np: np.ndarray | None = None
        self.events: list[Any] = []
        tag = f"layertap-rp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.ctrl_path = f"/dev/shm/{tag}"
        self.ring_path = ""
        with open(self.ctrl_path, "wb") as f:
            f.write(bytes(8 * CTRL_WORDS))
        self.ctrl = _map_ctrl(self.ctrl_path)
        try:
            cfg: dict[str, Any] = {"ctrl": self.ctrl_path, "ring_bytes": self.size, "staging": staging,
                                   "transport": transport_cfg, "run_meta": run_meta, "dtype": dtype_name,
                                   "n_planes": n_planes, "hidden": hidden, "row_bytes": row_bytes,
                                   "copy_chunk": max(0, int(copy_chunk)), "rows": rows,
                                   "log_level": log.getEffectiveLevel()}
            if staging == "cuda":
                self.ptr = rt.malloc(self.size)
                made = [rt.ipc_event() for _ in range(n_events)]
                self.events = [ev for ev, _ in made]
                cfg.update(cudart=rt.path, device=device, ring_handle=rt.mem_handle(self.ptr),
                           event_handles=[h for _, h in made])
            else:
                self.ring_path = f"/dev/shm/{tag}-ring"
                with open(self.ring_path, "wb") as f:
                    f.truncate(self.size)
                self.ring_np = np.memmap(self.ring_path, dtype=np.uint8, mode="r+", shape=(self.size,))
                cfg["ring_path"] = self.ring_path
            r, w = os.pipe()
            try:
                import fcntl

                fcntl.fcntl(w, 1031, PIPE_BYTES)  # F_SETPIPE_SZ: room for a few dozen descriptors
            except OSError:
                pass
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen([sys.executable, "-m", "layertap.engine.record_proc"], stdin=r, env=env)
            os.close(r)
            self.fd = w
            self._send(cfg)
            self._wait_ready(start_timeout)
        except BaseException:
            self.close(drain=False)
            raise

    # ---- start-up ----
    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.ctrl[READY] == 0:
            if self.proc.poll() is not None:
                raise RecordProcessError(f"the record process exited with status {self.proc.returncode} while "
                                         f"starting: {self.error_text()}")
            if time.monotonic() > deadline:
                raise RecordProcessError(f"the record process did not start within {timeout} s")
            time.sleep(0.01)
        if self.ctrl[READY] < 0:
            raise RecordProcessError(f"the record process failed to start: {self.error_text()}")
        os.unlink(self.ctrl_path)  # both processes have it mapped: no name is left behind if either is killed

    def error_text(self) -> str:
        try:
            with open(self.ctrl_path + ".err") as f:
                return f.read().strip() or "(no message)"
        except OSError:
            return "(no message)"

    # ---- per group, on the step thread ----
    def failed(self) -> bool:
        """Whether the record process reported an error (``check`` raises it)."""
        return bool(self.ctrl[ERROR])

    def check(self) -> None:
        """Raise by name if the record process reported an error (a word of shared memory: no syscall)."""
        if self.ctrl[ERROR]:
            raise RecordProcessError(f"the record process failed: {self.error_text()}")

    def alloc(self, nbytes: int) -> int | None:
        """A ring position for ``nbytes`` (waits while the record process is behind, up to ``wait_timeout``);
        ``None`` where the ring can never hold them (the caller takes the in-process path)."""
        need = -(-nbytes // ALIGN) * ALIGN
        if need > self.size:
            return None
        pos = self.head
        off = pos % self.size
        if off + need > self.size:  # no wrap inside a group: skip the ring's tail
            pos += self.size - off
        end = pos + need
        if end - int(self.ctrl[FREED]) > self.size:
            self._wait_room(end)
        self.head = end
        return pos

    def _wait_room(self, end: int) -> None:
        self.waits += 1
        deadline = time.monotonic() + self.wait_timeout
        pause = 2e-5
        while end - int(self.ctrl[FREED]) > self.size:
            self.check()
            if self.proc.poll() is not None:
                raise RecordProcessError(f"the record process exited (status {self.proc.returncode}) with records "
                                         f"in flight: {self.error_text()}")
            if time.monotonic() > deadline:
                raise RecordProcessError(f"the record process freed no staging room for {self.wait_timeout} s "
                                         "(the transport's consumer not keeping up?)")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def record_event(self, stream: int) -> int:
        """Record the next IPC event on ``stream`` (behind the gather); its index goes in the descriptor."""
        i = self.sent % len(self.events)
        self.events[i].record(stream)
        return i

    def send(self, pos: int, nbytes: int, event: int, items: list[tuple], shared: dict[str, Any]) -> None:
        """Hand one gathered group to the record process: ``items`` of (key, first row, rows, token ids (a
        list, or int64), the record's own manifest fields, which get the ids' digest there if they lack it); ``shared``: the fields every record of this engine
        carries (sent again only when it is a new dict)."""
        if shared is self._shared_sent:
            shared_out = None
        else:
            shared_out = self._shared_sent = shared
        # Token ids as a list go as their int64 bytes: struct packs 1,024 ids in 7.5 us where pickling the list
        # takes 10.5 (CPU machine, RESULTS 2026-12-07); the lists' pickle was most of the hand-over
        # (benchmarks/handover_cost.py). The record process hashes these bytes (ids_and_digest).
        items = [(k, a, n, token_bytes(ids) if isinstance(ids, list) else ids, m) for k, a, n, ids, m in items]
        self._send((pos % self.size, pos + -(-nbytes // ALIGN) * ALIGN, event, items, shared_out))
        self.sent += 1

    def _send(self, msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            _write_all(self.fd, struct.pack("<Q", len(data)) + data)
        except BrokenPipeError:
            raise RecordProcessError(f"the record process is gone (status {self.proc.poll()}): "
                                     f"{self.error_text()}") from None

    # ---- end ----
    def close(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Close the pipe: the record process commits what it was handed, then exits (``drain``: wait for it,
        up to ``timeout``); then the ring and the events go."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.proc is not None:
            try:
                self.proc.wait(timeout if drain else 0.01)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            if drain and self.proc.returncode not in (0, None):
                log.error("layertap: the record process exited with status %s: %s", self.proc.returncode,
                          self.error_text())
        if self.ptr and self.rt is not None:
            try:
                self.rt.free(self.ptr)  # the process that mapped it is gone
            except RuntimeError as e:
                log.warning("layertap: freeing the staging ring failed: %s", e)
            self.ptr = 0
        self.events = []
        self.ring_np = None
        for p in (self.ctrl_path, self.ctrl_path + ".err", self.ring_path):  # whichever still exist
            if p:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass


# ---------------------------------------------------------------------------------------------------------
# the record process
# ---------------------------------------------------------------------------------------------------------

def _read_exact(f: Any, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _read_msg(f: Any) -> Any:
    head = _read_exact(f, 8)
    if head is None:
        return None
    data = _read_exact(f, struct.unpack("<Q", head)[0])
    if data is None:
        return None
    return pickle.loads(data)


def record_specs(num_rows: int, dtype: Any, n_planes: int, hidden: int, loss_spans: Any) -> dict[str, tuple]:
    """A record's tensors as (dtype, shape): its token ids, its rows and, with loss spans, its loss mask. Both
    writers lay records out by these (``WorkerSide._specs``, the record process)."""
    specs = {"token_ids": (torch.int64, (num_rows,)), "hidden_states": (dtype, (num_rows, n_planes, hidden))}
    if loss_spans is not None:
        specs["loss_mask"] = (torch.uint8, (num_rows,))
    return specs


def pieces(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """(offset, length) of the copies that move ``nbytes`` in pieces of at most ``chunk`` bytes (0: one copy).
    A device-to-host copy queued behind another waits for all of it (one copy engine, in order; RESULTS
    2026-12-05: an 8-byte copy waited 642 us behind a 32 MiB one), so pieces bound that wait to one piece."""
    if chunk <= 0 or nbytes <= chunk:
        return [(0, nbytes)]
    return [(o, min(chunk, nbytes - o)) for o in range(0, nbytes, chunk)]


def fill_arrays(ids: np.ndarray, mask: np.ndarray | None, token_ids: np.ndarray, num_rows: int,
                loss_spans: Any) -> None:
    """A record's token ids and loss mask, written into host arrays of its transport memory (both writers)."""
    if num_rows:
        ids[:] = token_ids
    if mask is not None:
        mask[:] = 0
        for a, b in loss_spans:
            mask[a:b] = 1


class _Writer:
    """The record process's work: descriptors in, committed records out."""

    def __init__(self, cfg: dict[str, Any]):
        self.cfg = cfg
        self.ctrl = _map_ctrl(cfg["ctrl"])
        self.dtype = getattr(torch, cfg["dtype"])
        self.n_planes, self.hidden, self.rb = cfg["n_planes"], cfg["hidden"], cfg["row_bytes"]
        self.run_meta = cfg["run_meta"]
        self.template = None
        self.shared: dict[str, Any] = {}
        self.sink = get_transport(cfg["transport"]["backend"]).make_sink(
            cfg["transport"], f"{socket.gethostname()}-{os.getpid()}-records")
        self.cuda = cfg["staging"] == "cuda"
        self.chunk, self.rows = cfg.get("copy_chunk", 0), cfg.get("rows", "copy")
        self.gpu = self.cuda and self.rows != "nogpu"  # "nogpu": no CUDA call (a benchmark aid)
        self.registered = self.ring_ptr = 0
        try:  # a set-up that fails leaves the pool without this writer (the consumer would call it dead)
            region = self.sink.data_region()
            self.region_np = region.numpy()
            self.region_ptr = region.data_ptr()
            self.region_bytes = region.numel()
            if self.gpu:
                self.rt = IpcRuntime(cfg["cudart"])
                self.rt.set_device(cfg["device"])
                self.ring_ptr = self.rt.open_mem(cfg["ring_handle"])
                self.events = [self.rt.open_event(h) for h in cfg["event_handles"]]
                self.stream = self.rt.stream()
                self.rt.host_register(self.region_ptr, self.region_bytes)
                self.registered = 1
                self.done = self.rt.rc.event(blocking=True)
            elif not self.cuda:
                self.ring_np = np.memmap(cfg["ring_path"], dtype=np.uint8, mode="r", shape=(cfg["ring_bytes"],))
        except BaseException:
            self.close()
            raise

    def manifest(self, n: int, meta: dict[str, Any]) -> tuple[dict[str, tuple], dict[str, Any], Any]:
        specs = record_specs(n, self.dtype, self.n_planes, self.hidden, meta.get("loss_spans"))
        if "dtype" in meta:  # the record's own field wins: no template (as WorkerSide._manifest)
            return specs, {**self.run_meta, **self.shared, **meta, "dtype": self.cfg["dtype"]}, None
        if self.template is None:
            self.template = MetaTemplate({**self.run_meta, **self.shared, "dtype": self.cfg["dtype"]})
        return specs, meta, self.template

    def reserve(self, key: str, n: int, meta: dict[str, Any], deadline: float) -> Any:
        specs, fields, tmpl = self.manifest(n, meta)
        while True:
            res = self.sink.reserve(key, specs, fields, template=tmpl, views=False)
            if res is not None:
                return res
            if time.monotonic() > deadline:
                raise TransportFull(f"no free slot for record {key} within {self.sink.put_timeout} s "
                                    "(the consumer is not keeping up); not committed")
            self.sink.bell.wait(0.01)  # the consumer rings on every release

    def group(self, msg: tuple) -> None:
        off, end, event, items, shared = msg
        if shared is not None:
            self.shared, self.template = shared, None
        if self.gpu:
            self.rt.rc.wait_event(self.stream, self.events[event])
        deadline = time.monotonic() + self.sink.put_timeout
        reservations: list[Any] = []
        try:
            for key, a, n, token_ids, meta in items:
                if "token_digest" not in meta:  # the scheduler left the conversion and the hash to the writer
                    token_ids, meta["token_digest"] = ids_and_digest(token_ids)
                res = self.reserve(key, n, meta, deadline)
                reservations.append(res)
                o, m = res.offsets["token_ids"], res.offsets.get("loss_mask")
                fill_arrays(self.region_np[o:o + 8 * n].view(np.int64),
                            None if m is None else self.region_np[m:m + n], token_ids, n, meta.get("loss_spans"))
                dst, src, nb = res.offsets["hidden_states"], off + a * self.rb, n * self.rb
                if self.rows != "copy":
                    continue
                for o, k in pieces(nb, self.chunk):
                    if self.cuda:
                        self.rt.rc.copy(self.region_ptr + dst + o, self.ring_ptr + src + o, k, 2, self.stream)
                    else:
                        self.region_np[dst + o:dst + o + k] = self.ring_np[src + o:src + o + k]
            if self.gpu:
                self.done.record(self.stream)
                self.done.synchronize()
        except BaseException:
            for res in reservations:
                res.abort()
            raise
        for res in reservations:
            res.commit()
        self.ctrl[FREED] = end  # the ring up to here is free again

    def close(self) -> None:
        self.sink.close()
        if self.registered:
            self.rt.host_unregister(self.region_ptr)
        if self.ring_ptr:
            self.rt.close_mem(self.ring_ptr)


def main() -> int:
    stdin = sys.stdin.buffer
    cfg = _read_msg(stdin)
    if cfg is None:
        return 0
    logging.basicConfig(level=cfg.get("log_level", logging.INFO),
                        format="%(levelname)s %(asctime)s [record process] %(message)s")
    ctrl = _map_ctrl(cfg["ctrl"])
    w = None
    try:
        w = _Writer(cfg)
        ctrl[READY] = 1
        log.info("layertap record process %d: ring of %d MiB (%s), pool %s", os.getpid(), cfg["ring_bytes"] >> 20,
                 cfg["staging"], cfg["transport"].get("name"))
        while True:
            msg = _read_msg(stdin)
            if msg is None:  # the engine closed its end (it ended, or was killed)
                break
            w.group(msg)
    except BaseException as e:
        import traceback

        with open(cfg["ctrl"] + ".err", "w") as f:
            f.write(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        if ctrl[READY] == 0:
            ctrl[READY] = -1
        ctrl[ERROR] = 1
        log.error("layertap record process failed: %r", e)
        return 1
    finally:
        if w is not None:
            try:
                w.close()
            except Exception as e:  # noqa: BLE001  (exiting either way)
                log.warning("layertap record process: closing: %r", e)
    return 0


if __name__ == "__main__":  # run as the imported module, not a second copy of it named __main__
    from layertap.engine.record_proc import main as _main

    sys.exit(_main())
