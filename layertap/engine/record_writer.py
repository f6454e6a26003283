"""The connector's worker side: reads a finished request's rows from the capture layer by its own block ids
and turns them into committed records (see ``connector``'s docstring for the protocol, ``gpu_gather`` for the
CUDA stream rules). Runs in each worker process; only TP rank 0 reads and writes."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from layertap.engine import compat
from layertap.engine.cache_view import CacheLayoutError, gather_blocks, kernel_ratio, slots_for, view_blocks_for, view_geometry
from layertap.engine.gpu_gather import (
    IndexUpload,
    RawCopies,
    RawEvent,
    copy_to_host,
    gather_on_device,
    register_host,
    spans_of,
    unregister_host,
)
from layertap.engine.record_proc import fill_arrays, record_specs
from layertap.engine.saves import LayertapMetadata, SaveJob, SlotCheckError
from layertap.records import MetaTemplate, ids_and_digest
from layertap.transport.base import get_transport

log = logging.getLogger("vllm.layertap")


PHASES = ("blocks", "staging", "index", "gather", "reserve", "copies", "send")
"""The CUDA record path's phases on the step thread: the records' view blocks (``view_blocks_for``); the
staging bound (``_bound_staging``, or the record process's ring room: waits only when the copies are behind);
the index upload (record process path only; the other paths count it in the gather); the gather (event,
gather kernel, the forward stream's wait); the transport reservations (slot claim, header, token ids); the
host copies and device commits queued on the copy stream (record process path: the descriptor's spans);
the hand-over to the record process (the descriptor pickled and written into its pipe)."""


class _DeviceBytes:
    """Device memory this process allocated itself (the record process's staging ring), as torch takes it:
    ``torch.as_tensor`` reads ``__cuda_array_interface__`` and views the memory, no copy."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def _abort(reservations: list[Any]) -> None:
    """Give back transport memory reserved for records that will not be committed."""
    for res in reservations:
        if res is not None:
            res.abort()


class WorkerSide:
    """Rows -> records: gathers, reserves transport memory, copies, commits (or hands to the writer thread)."""

    def __init__(self, c: Any, vllm_config: Any):
        self.c = c
        self.vllm_config = vllm_config
        self.hidden = compat.hidden_size(vllm_config)
        self.n_layers = compat.num_layers(vllm_config)
        self.run_meta = dict(c._extra.get("run_meta", {}))
        self.transport_cfg = dict(c._extra["transport"])
        self.compact_cfg = self.transport_cfg.get("compact")
        self.view: torch.Tensor | None = None
        self.on_cuda = False  # the view is on a CUDA device (set by register)
        self.rank0 = True
        self.sink = None
        self.released: set[str] = set()  # requests whose rows are read (or safely gathered): blocks may go
        self.jobs: queue.Queue = queue.Queue(maxsize=int(c._extra.get("writer_queue", 64)))
        self.error: BaseException | None = None
        self.writer: threading.Thread | None = None
        self.stream = None
        self.copy_stream = None
        self.staging = threading.Condition()  # device bytes gathered whose host copies are not done yet
        self.staged_bytes = 0
        self.checked = 0
        # Records are laid out in transport memory and filled in place when the transport can (shm): on
        # CUDA the device-to-host copy lands in the registered pool, no staging buffer, no host memcpy.
        self.direct = bool(c._extra.get("direct", True)) and not self.compact_cfg
        # CUDA: the step thread reserves transport memory and queues the host copies. Doing it on the writer
        # thread instead took it off the engine's critical path but competed with the step thread for the
        # GIL; paired on the H200 (RESULTS.md, 2026-12-01, run N) neither won, and that variant is gone.
        # A thread that waits for host copies sleeps (cudaEventBlockingSync), it does not spin.
        # CUDA + a transport that allows it (shm without a payload checksum): each record's commit is a
        # 4-byte copy queued on the copy stream after its payload (gpu_gather rule 5), so no thread of the
        # engine waits for copies or commits records; the writer thread only serves the other paths.
        # False (connector option device_commit): the writer thread waits for each group's copies and
        # commits on the CPU, as it does for a checksummed transport.
        self.device_commit = bool(c._extra.get("device_commit", True))
        self.commit_word: torch.Tensor | None = None  # on the device, once registered
        # CUDA + device commits (connector option ``lean``, default on): the lean record path. The gather
        # runs on the forward stream itself (stream order keeps the blocks' next writer after it: no side
        # stream, no events around it), its index comes from a page-locked ring (no allocation per step),
        # the transport memory is reserved as byte offsets (no tensor views), and the payload and commit
        # copies are raw cudaMemcpyAsync calls: ~10 torch/CUDA calls per step instead of ~20 plus 4 per
        # record, each 3-35 us of the step thread on the H200 host (RESULTS 2026-12-03, sixth lease).
        self.lean_wanted = bool(c._extra.get("lean", True))
        self.lean = False  # set by open_transport where it applies
        self.copies: RawCopies | None = None
        self.index_upload: IndexUpload | None = None
        self.region_np: np.ndarray | None = None
        self.region_ptr = 0
        self.inflight: list[tuple[Any, int]] = []  # (copy event, device bytes) of device-committed groups
        self.pinned_region: torch.Tensor | None = None
        # The lean path with a record process (connector option ``offload``, default on): the step thread only
        # gathers into a device staging ring shared with that process and hands it a descriptor; the process
        # reserves, copies and commits (``record_proc``). ``offload_staging_mb``: the ring's size.
        self.offload_wanted = bool(c._extra.get("offload", True))
        self.offload_mb = int(c._extra.get("offload_staging_mb", 512))
        # The record process's copies in pieces of at most this many KiB (0: one copy a record). Meant to let a
        # small device-to-host copy of the engine's own (its sampled ids) pass between pieces; on the H100 it
        # does not (it waited 264 us behind another process's 1 MiB pieces, 234 behind whole 16 MiB copies:
        # benchmarks/d2h_bandwidth.py, RESULTS 2026-12-07), so the default stays one copy a record.
        self.offload_chunk_kb = int(c._extra.get("offload_copy_chunk_kb", 0))
        # Benchmark aid only (record_proc.ROW_MODES): "skip" leaves the rows uncopied, "nogpu" also makes no
        # CUDA call in the record process; records then carry whatever their slot held.
        self.offload_rows = str(c._extra.get("offload_rows", "copy"))
        self.rp = None  # the RecordProcess, once started
        self.ring_t: torch.Tensor | None = None
        # Benchmark aid only (benchmarks/capture_overhead.py "floor"): saves are reported done without
        # reading any row, which measures what the capture path costs the engine by itself.
        self.skip_reads = bool(c._extra.get("skip_reads", False))
        # Benchmark aid only ("floor-gather"): on CUDA the rows are gathered on the device as for a record
        # (the forward stream waits for the gather), then dropped: no transport memory, no host copy, no
        # record. Beside "floor" it splits the record path's cost into the gather and the rest.
        self.gather_only = bool(c._extra.get("gather_only", False))
        # Time the engine's step spends in layertap's per-step work (logged at close): what capture costs
        # the worker's critical path.
        self.busy_s = 0.0
        self.calls = 0
        self.saved = 0
        # Where that time goes on CUDA, per phase of a step with records (the close log prints it per record):
        # a few perf_counter reads per group, so a GPU run's log says which part of the record path to cut.
        self.phase_s = dict.fromkeys(PHASES, 0.0)
        self._shared: dict[str, Any] | None = None  # the scheduler's shared manifest fields last seen
        self._meta_template: MetaTemplate | None = None

    # ---- set-up ----
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.rank0 = compat.tp_rank() == 0
        name = compat.capture_layer_name(list(kv_caches))
        view = kv_caches[name]
        self.attach(name, view, compat.capture_plane_axis(compat.vllm_version()))
        log.info(
            "layertap worker: capture layer %s; hidden-state group %d, manager block size %d; view shape %s "
            "strides %s dtype %s device %s; plane axis %d, view block size %d (%d kernel blocks per manager "
            "block); %d manager blocks; layer ids %s; tp rank0=%s",
            name, self.c._group, self.c._block_size, tuple(view.shape), tuple(view.stride()), view.dtype,
            view.device, self.geo.plane_axis, self.geo.view_block_size, self.ratio, self.num_manager_blocks,
            self.c._layer_ids, self.rank0,
        )
        for lid in self.c._layer_ids:
            if not 0 <= lid <= self.n_layers:
                raise CacheLayoutError(f"layer id {lid} outside 0..{self.n_layers}")
        if view.is_cuda and self.c._extra.get("capture_path", "hook") == "hook":
            mode = compat.decode_graph_mode(self.vllm_config)
            if compat.wants_full_graphs(self.c._extra) and mode == "PIECEWISE":
                # loud: every decode step then launches each attention layer eagerly (half the serving
                # throughput on the H200, RESULTS.md 2026-12-02); vLLM's log says which backend refused
                compat.wlog.warning("layertap hook: FULL CUDA graphs were asked for, but vLLM runs decode steps "
                                    "with PIECEWISE graphs (an attention backend without graph support?)")
            else:
                compat.wlog.info("layertap hook: decode steps run with %s CUDA graphs", mode)
        if self.rank0 and not self.skip_reads:
            self.open_transport()

    def attach(self, name: str, view: torch.Tensor, plane_axis: int) -> None:
        """Take the capture layer's cache view: its geometry and what every record's rows are read with."""
        self.geo = view_geometry(tuple(view.shape), len(self.c._layer_ids), self.hidden, plane_axis=plane_axis)
        self.ratio = kernel_ratio(self.c._block_size, self.geo.view_block_size)
        self.num_manager_blocks = self.geo.num_blocks // self.ratio
        self.view = view
        self.dtype_name = str(view.dtype).removeprefix("torch.")  # the records' "dtype" meta
        self.on_cuda = view.is_cuda
        self.layer_name = name
        self.row_bytes = self.geo.n_planes * self.geo.hidden * view.element_size()

    def open_transport(self) -> None:
        """The sink records go to; on CUDA its memory page-locked for direct copies, the copy streams, the
        device commit word; the writer thread."""
        view = self.view
        if view.is_cuda:
            self.stream = torch.cuda.Stream(device=view.device)
            self.copy_stream = torch.cuda.Stream(device=view.device)
        if self.gather_only:  # benchmark aid: rows are gathered and dropped, no record is written
            return
        writer_id = f"{socket.gethostname()}-{os.getpid()}"
        self.sink = get_transport(self.transport_cfg["backend"]).make_sink(self.transport_cfg, writer_id)
        if view.is_cuda and self.direct and hasattr(self.sink, "data_region"):
            region = self.sink.data_region()
            err = register_host(region)
            if err is None:
                self.pinned_region = region
                if self.device_commit and getattr(self.sink, "device_commit_ok", False):
                    self.commit_word = self.sink.commit_word().to(view.device)  # set: records commit on the device
                    if self.lean_wanted:
                        self._open_lean(region)
                log.info("layertap worker: %d MiB of transport memory page-locked; rows go to it directly; "
                         "records commit %s; %s record path", region.numel() >> 20,
                         "on the device (a commit word copied after each payload)" if self.commit_word is not None
                         else "on the writer thread, after their copies", "lean" if self.lean else "torch")
            else:
                self.direct = False
                log.warning("layertap worker: cannot page-lock the transport memory (%s); staging rows "
                            "through pinned buffers instead", err)
        self.writer = threading.Thread(target=self._write_loop, name="layertap-writer", daemon=True)
        self.writer.start()

    def _open_lean(self, region: torch.Tensor) -> None:
        self.copies = RawCopies.load()
        if self.copies is None:
            log.warning("layertap worker: no CUDA runtime library is mapped in this process (torch linked it "
                        "statically?); records take the torch record path")
            return
        self.region_ptr, self.region_np = region.data_ptr(), region.numpy()
        self.index_upload = IndexUpload(self.view.device, self.copies)
        self.gathered = self.copies.event()  # re-recorded every step (a stream wait takes the record as it is)
        self.done_events: list[Any] = []  # raw copy-completion events of reaped groups, for reuse
        self.commit_word_ptr = self.commit_word.data_ptr()
        self.lean = True
        if self.offload_wanted:
            self._open_offload()

    def _open_offload(self) -> None:
        """Start the record process (``record_proc``) with a staging ring on the view's device; where it cannot
        start, say why and keep the in-process lean path."""
        from layertap.engine.record_proc import IpcRuntime, RecordProcess, RecordProcessError

        try:
            self.rp = RecordProcess(
                transport_cfg=self.transport_cfg, run_meta=self.run_meta, dtype_name=self.dtype_name,
                n_planes=self.geo.n_planes, hidden=self.geo.hidden, row_bytes=self.row_bytes,
                ring_bytes=self.offload_mb << 20, rt=IpcRuntime(self.copies.path), device=self.view.device.index or 0,
                copy_chunk=self.offload_chunk_kb << 10, rows=self.offload_rows)
        except (RecordProcessError, RuntimeError, OSError) as e:
            log.warning("layertap worker: the record process did not start (%s); records are reserved, copied and "
                        "committed on the step thread", e)
            self.rp = None
            return
        self.ring_t = torch.as_tensor(_DeviceBytes(self.rp.ptr, self.rp.size), device=self.view.device
                                      ).view(self.view.dtype)
        self.block_elems = self.view[0].numel()
        log.info("layertap worker: record process %d started (staging ring %d MiB on %s); the step thread gathers, "
                 "the record process copies and commits", self.rp.proc.pid, self.rp.size >> 20, self.view.device)

    # ---- first-step slot check ----
    def check_unrun(self, meta: Any) -> None:
        """After a step: slot checks that the forward did not run (a FULL CUDA-graph replay runs no Python
        hook) are run here against the slot mapping the step used, or fail by name where it is unreadable."""
        if not isinstance(meta, LayertapMetadata) or not meta.checks:
            return
        name = getattr(self, "layer_name", None)
        slots = compat.step_slot_mapping(name, meta.num_tokens) if name else None
        if slots is None:
            raise SlotCheckError(f"{len(meta.checks)} slot checks did not run in this step's forward (a FULL CUDA "
                                 "graph replay?) and the step's slot mapping is not readable after it")
        self.check_slots(name, SimpleNamespace(slot_mapping=slots), meta)  # metadata where only the slots are known

    def check_slots(self, layer_name: str, attn_metadata: Any, meta: Any) -> None:
        if layer_name != getattr(self, "layer_name", None) or not isinstance(meta, LayertapMetadata) or not meta.checks:
            return
        if isinstance(attn_metadata, dict):
            attn_metadata = attn_metadata.get(layer_name)
        written = getattr(attn_metadata, "slot_mapping", None)
        if written is None:
            raise SlotCheckError("capture layer metadata carries no slot_mapping; cannot verify the slots it wrote")
        written_set = set(written.detach().cpu().tolist())
        for chk in meta.checks:
            want = slots_for(chk.block_ids, self.c._block_size, chk.start, chk.stop, request=chk.req_id,
                             num_manager_blocks=self.num_manager_blocks)
            missing = [s for s in want.tolist() if s not in written_set]
            if missing:
                raise SlotCheckError(
                    f"request {chk.req_id}: positions [{chk.start}, {chk.stop}) map to slots {want.tolist()[:8]}..., "
                    f"but this step wrote none of {missing[:8]} (block size {self.c._block_size}, blocks "
                    f"{chk.block_ids[:8]})"
                )
            self.checked += 1
        log.info("layertap worker: slot check passed for %d scheduled requests (%d so far)", len(meta.checks),
                 self.checked)
        meta.checks.clear()  # checked once per step (save_kv_layer may run more than once)

    # ---- finished requests ----
    def finished(self, meta: Any) -> set[str] | None:
        t0 = time.perf_counter()
        try:
            return self._finished(meta)
        finally:
            self.busy_s += time.perf_counter() - t0
            self.calls += 1

    def idle(self) -> bool:
        """Nothing to report and nothing wrong: a step without saves or checks may skip the connector's round
        (``LayertapConnector.quiet_empty_step``). False once anything failed, so that round raises it."""
        return not self.released and self.error is None and (self.rp is None or not self.rp.failed())

    def _finished(self, meta: Any) -> set[str] | None:
        if self.error is not None:
            raise RuntimeError(f"layertap writer failed: {self.error}") from self.error
        if self.rp is not None:
            self.rp.check()  # a word of shared memory: raises by name once the record process failed
        if isinstance(meta, LayertapMetadata) and self.rank0 and meta.saves:
            if self.on_cuda and not self.skip_reads:
                self._start_copies_cuda(meta.saves)
            else:
                for job in meta.saves:
                    self._start_copy(job)
        done, self.released = self.released, set()
        return done or None

    def _specs(self, job: SaveJob) -> dict[str, tuple]:
        return record_specs(job.num_rows, self.view.dtype, self.geo.n_planes, self.geo.hidden, job.meta.get("loss_spans"))

    @staticmethod
    def _prepare(job: SaveJob) -> None:
        """The record's token ids as int64 and their digest in its manifest, made once, by its writer (the
        scheduler hands the ids as it has them: ``SaveJob.token_ids``)."""
        if "token_digest" not in job.meta:
            job.token_ids, job.meta["token_digest"] = ids_and_digest(job.token_ids)

    def _record_layout(self, job: SaveJob) -> tuple[dict[str, tuple], dict[str, Any]]:
        """The record's tensor specs and its whole manifest (the staged paths, which ``put`` a record)."""
        self._prepare(job)
        return self._specs(job), {**self.run_meta, **job.shared, **job.meta, "dtype": self.dtype_name}

    def _manifest(self, job: SaveJob) -> tuple[dict[str, tuple], dict[str, Any], MetaTemplate | None]:
        """What a reservation lays out: the specs, the record's own fields and the shared ones' template (the
        manifest ``_record_layout`` gives, without encoding the shared fields per record)."""
        self._prepare(job)
        if "dtype" in job.meta:  # the writer's field wins, as in _record_layout: no template then
            return (*self._record_layout(job), None)
        return self._specs(job), job.meta, self._template(job)

    def _template(self, job: SaveJob) -> MetaTemplate:
        """The manifest fields all records share, encoded once (``records.MetaTemplate``): this run's, the
        scheduler's ``job.shared`` and the dtype. The record's own fields (``job.meta``) go on top, as in
        ``_record_layout``. Kept per ``shared`` dict (one per scheduler; a new one per step where the metadata
        reaches this process pickled)."""
        if self._shared is not job.shared:
            self._shared = job.shared  # held: its id is not reused while the template is
            self._meta_template = MetaTemplate({**self.run_meta, **job.shared, "dtype": self.dtype_name})
        return self._meta_template

    @staticmethod
    def _fill_small(tensors: dict[str, torch.Tensor], job: SaveJob) -> None:
        # token_ids: host memory of shape (num_rows,), int64 (a transport slot or a CPU tensor), filled in place
        WorkerSide._fill_arrays(tensors["token_ids"].numpy(),
                                tensors["loss_mask"].numpy() if "loss_mask" in tensors else None, job)

    @staticmethod
    def _fill_arrays(ids: np.ndarray, mask: np.ndarray | None, job: SaveJob) -> None:
        """The record's token ids and loss mask, written into host arrays of its transport memory."""
        fill_arrays(ids, mask, job.token_ids, job.num_rows, job.meta.get("loss_spans"))

    def _blocks(self, job: SaveJob) -> list[int]:
        """The view blocks holding the record's rows (its first ``num_rows`` positions), checked."""
        self.saved += 1
        return view_blocks_for(job.block_ids, self.c._block_size, job.num_rows, self.ratio, request=job.req_id,
                               num_manager_blocks=self.num_manager_blocks)

    def _reserve(self, job: SaveJob, device_commit: bool = False) -> Any:
        """The record's transport memory, reserved and filled but for the rows (``None``: no free room right
        now, or a transport without ``reserve``: the rows are staged and put instead)."""
        if not self.direct:
            return None
        specs, meta, tmpl = self._manifest(job)
        res = self.sink.reserve(job.key, specs, meta, template=tmpl, device_commit=True) if device_commit \
            else self.sink.reserve(job.key, specs, meta, template=tmpl)
        if res is not None:
            self._fill_small(res.tensors, job)
        return res

    def _start_copy(self, job: SaveJob) -> None:
        """One record on the CPU (the copy is done when this returns); CUDA goes through _start_copies_cuda."""
        if self.skip_reads:
            self.saved += 1
            if job.release:
                self.released.add(job.req_id)
            return
        blocks = self._blocks(job)
        res = None if self.gather_only else self._reserve(job)
        # advanced indexing copies: the rows are ours now, the blocks may go
        rows = gather_blocks(self.view, self.geo, torch.tensor(blocks, dtype=torch.int64))[: job.num_rows]
        if job.release:
            self.released.add(job.req_id)
        if self.gather_only:
            return
        if res is not None:  # laid out in place: the copy is done, the commit is a few stores
            try:
                res.tensors["hidden_states"].copy_(rows)
            except BaseException:
                res.abort()
                raise
            res.commit()
            return
        # blocks when the writer is behind: the engine slows, nothing drops
        self.jobs.put(("host", job, rows, None))

    # The rows of one step's finished records are gathered together, in groups of at most this many bytes
    # of device memory.
    BATCH_BYTES = 512 << 20

    def _start_copies_cuda(self, jobs: list[SaveJob]) -> None:
        """All records of this step, in one gather per group (by cache block); then their transport memory
        is reserved and the host copies queued (on the copy stream; the writer thread only waits where the
        commit is not on the device)."""
        vbytes = self.geo.view_block_size * self.row_bytes
        group: list[SaveJob] = []
        lists: list[list[int]] = []
        size = 0
        for job in jobs:
            t0 = time.perf_counter()
            blocks = self._blocks(job)
            self.phase_s["blocks"] += time.perf_counter() - t0
            if group and size + len(blocks) * vbytes > self.BATCH_BYTES:
                self._gather_group(group, lists, size)
                group, lists, size = [], [], 0
            group.append(job)
            lists.append(blocks)
            size += len(blocks) * vbytes
        if group:
            self._gather_group(group, lists, size)

    def _lap(self, phase: str, t0: float) -> float:
        t = time.perf_counter()
        self.phase_s[phase] += t - t0
        return t

    def _gather_group(self, group: list[SaveJob], lists: list[list[int]], nbytes: int) -> None:
        if self.rp is not None:
            self._gather_group_offload(group, lists, nbytes)
            return
        if self.lean:
            self._gather_group_lean(group, lists, nbytes)
            return
        t = time.perf_counter()
        self._bound_staging(nbytes)
        t = self._lap("staging", t)
        # The forward stream waits for the gather kernel (gpu_gather rule 3), so the blocks are free to be
        # reused as soon as this returns: they are reported done in this very step, and the engine runs no
        # extra steps waiting for the host copy.
        rows, gathered, keep = gather_on_device(self.view, self.geo, lists, self.stream, hold_forward=True)
        t = self._lap("gather", t)
        if self.gather_only:  # benchmark aid (see __init__): the rows go back to the gather stream's pool
            self.released.update(job.req_id for job in group if job.release)
            self._unstage(nbytes)
            return
        spans = spans_of(lists, [job.num_rows for job in group], self.geo.view_block_size)
        for job in group:
            if job.release:
                self.released.add(job.req_id)
        self._copy_group(group, rows, gathered, spans, nbytes, keep, t)

    def _copy_group(self, group: list[SaveJob], rows: torch.Tensor, gathered: Any, spans: list[tuple[int, int]],
                    nbytes: int, keep: Any, t: float) -> None:
        """The torch record path after the gather: reservations with tensor views, the host copies and
        (device commit) the commit words, or the writer thread's commit."""
        reservations: list[Any] = []
        try:
            for job in group:
                reservations.append(self._reserve(job, self.commit_word is not None))
            dsts = [res.tensors["hidden_states"] if res is not None else None for res in reservations]
            t = self._lap("reserve", t)
            if self.commit_word is not None and all(res is not None for res in reservations):
                self._copy_and_commit_on_device(rows, spans, dsts, reservations, gathered, nbytes)
                self._lap("copies", t)
                return
            hosts, done = copy_to_host(rows, spans, dsts, self.copy_stream, gathered)
            self._lap("copies", t)
        except BaseException:
            _abort(reservations)
            self._unstage(nbytes)
            raise
        self.jobs.put(("copied", group, hosts, reservations, done, (rows, keep), nbytes))

    def _gather_group_lean(self, group: list[SaveJob], lists: list[list[int]], nbytes: int) -> None:
        """The lean record path (see ``__init__``): gather on the forward stream, reserve byte offsets,
        queue raw payload copies and then the commit words on the copy stream; nothing waits."""
        t = time.perf_counter()
        self._bound_staging(nbytes)
        t = self._lap("staging", t)
        try:
            # On the forward stream: whatever the next forward writes into these blocks runs after the
            # gather read them (stream order), so they are released in this very step, as on the torch path.
            # Events are raw runtime calls, made once (RawEvent): a torch Event's create, record and wait cost
            # 5-15 us each on the GPU hosts' step thread.
            fwd, copy_stream = torch.cuda.current_stream().cuda_stream, self.copy_stream.cuda_stream
            rows = gather_blocks(self.view, self.geo, self.index_upload(lists, fwd))
            self.gathered.record(fwd)
            self.copies.wait_event(copy_stream, self.gathered)  # the wait takes the record as it is now
            rows.record_stream(self.copy_stream)  # not reused before the copies queued below ran
        except BaseException:
            self._unstage(nbytes)
            raise
        t = self._lap("gather", t)
        spans = spans_of(lists, [job.num_rows for job in group], self.geo.view_block_size)
        for job in group:
            if job.release:
                self.released.add(job.req_id)
        reservations: list[Any] = []
        for job in group:
            try:
                res = self._reserve_raw(job)
            except BaseException:
                _abort(reservations)
                self._unstage(nbytes)
                raise
            if res is None:  # no room in the pool right now: this group takes the torch path's fallback
                _abort(reservations)
                after = torch.cuda.Event()  # the torch path's copies wait on a torch event: recorded behind the
                after.record()  # gather on the forward stream (nothing else was queued there since)
                self._copy_group(group, rows, after, spans, nbytes, None, t)
                return
            reservations.append(res)
        t = self._lap("reserve", t)
        copies, src, rb = self.copies, rows.data_ptr(), self.row_bytes
        queued = 0
        try:
            for (a, n), res in zip(spans, reservations):
                copies.copy(self.region_ptr + res.offsets["hidden_states"], src + a * rb, n * rb, RawCopies.D2H,
                            copy_stream)
            for res in reservations:  # after every payload: an error above leaves nothing committed
                copies.copy(self.region_ptr + res.state_at, self.commit_word_ptr, 4, RawCopies.D2H, copy_stream)
                res.handed_to_device()
                queued += 1
            done = self.done_events.pop() if self.done_events else copies.event(blocking=True)
            done.record(copy_stream)
        except BaseException:  # the engine stops on it; the rows stay held by record_stream either way
            _abort(reservations[queued:])
            self._unstage(nbytes)
            raise
        self.sink.wake_consumer()  # one ring for the group: a consumer already waiting looks at once
        with self.staging:
            self.inflight.append((done, nbytes))  # staged bytes stay counted until the copies ran
        self._lap("copies", t)

    def _gather_group_offload(self, group: list[SaveJob], lists: list[list[int]], nbytes: int) -> None:
        """The record process's share of the lean path: the gather on the forward stream into the staging ring
        (so the blocks are released in this step, as on the lean path), an IPC event behind it, a descriptor
        into the pipe; the process reserves, copies and commits (``record_proc``)."""
        rp = self.rp
        t = time.perf_counter()
        pos = rp.alloc(nbytes)  # waits while the record process is behind (back-pressure), up to its limit
        if pos is None:  # a group larger than the whole ring
            self._gather_group_lean(group, lists, nbytes)
            return
        t = self._lap("staging", t)
        fwd = torch.cuda.current_stream().cuda_stream
        index = self.index_upload(lists, fwd)
        t = self._lap("index", t)
        off = (pos % rp.size) // self.view.element_size()
        if self.geo.plane_axis == 2:  # blocks of [block, planes, hidden]: rows in order, gathered in place
            n = index.shape[0]
            out = self.ring_t[off:off + n * self.block_elems].view(n, *self.view.shape[1:])
            torch.index_select(self.view, 0, index, out=out)
        else:  # [planes, block, hidden] blocks: rows made contiguous, then placed
            rows = gather_blocks(self.view, self.geo, index)
            self.ring_t[off:off + rows.numel()].view(rows.shape).copy_(rows)
        event = rp.record_event(fwd)
        t = self._lap("gather", t)
        spans = spans_of(lists, [job.num_rows for job in group], self.geo.view_block_size)
        items = [(job.key, a, n, job.token_ids, job.meta) for job, (a, n) in zip(group, spans)]
        t = self._lap("copies", t)
        rp.send(pos, nbytes, event, items, group[0].shared)
        for job in group:
            if job.release:
                self.released.add(job.req_id)
        self._lap("send", t)

    def _reserve_raw(self, job: SaveJob) -> Any:
        """The record's transport memory as byte offsets (lean path), its token ids and loss mask written
        through numpy; ``None``: no free room right now."""
        specs, meta, tmpl = self._manifest(job)
        res = self.sink.reserve(job.key, specs, meta, template=tmpl, device_commit=True, views=False)
        if res is None:
            return None
        o, m = res.offsets["token_ids"], res.offsets.get("loss_mask")
        self._fill_arrays(self.region_np[o:o + 8 * job.num_rows].view(np.int64),
                          None if m is None else self.region_np[m:m + job.num_rows], job)
        return res

    def _copy_and_commit_on_device(self, rows: torch.Tensor, spans: list[tuple[int, int]], dsts: list[torch.Tensor],
                                   reservations: list[Any], gathered: Any, nbytes: int) -> None:
        """Queue the payload copies and then each record's commit word on the copy stream; nothing waits.
        The gathered rows go back to the caching allocator tied to the copy stream (not reused before the
        copies ran); the index's pinned source is held by the caching host allocator until its upload ran.
        A reservation whose slots no device word reached (the copies failed to queue) is aborted by the
        caller; one whose word was queued commits itself."""
        _, done = copy_to_host(rows, spans, dsts, self.copy_stream, gathered,
                               commits=[res.commit_target for res in reservations], commit_word=self.commit_word)
        for res in reservations:
            res.handed_to_device()
        self.sink.wake_consumer()  # one ring for the group: a consumer already waiting looks at once
        rows.record_stream(self.copy_stream)
        with self.staging:
            self.inflight.append((done, nbytes))  # staged bytes stay counted until the copies ran

    # Device memory the gathered rows may hold while their host copies are in flight; past it the step
    # waits for the writer (backpressure instead of an out-of-memory error in the engine).
    MAX_STAGED_BYTES = 2 << 30

    def _reap(self, wait: bool = False) -> None:
        """Uncount device-committed groups whose copies ran (``wait``: wait for the oldest one first).
        Caller holds ``self.staging``."""
        if wait and self.inflight:
            self.inflight[0][0].synchronize()
        while self.inflight and self.inflight[0][0].query():
            done, nbytes = self.inflight.pop(0)
            self.staged_bytes -= nbytes
            if isinstance(done, RawEvent):
                self.done_events.append(done)

    def _bound_staging(self, nbytes: int) -> None:
        with self.staging:
            self._reap()
            while self.staged_bytes and self.staged_bytes + nbytes > self.MAX_STAGED_BYTES:
                if self.error is not None:
                    raise RuntimeError(f"layertap writer failed: {self.error}") from self.error
                if self.inflight:
                    self._reap(wait=True)  # the device copies are behind: the engine waits for the oldest
                else:
                    self.staging.wait(timeout=0.5)
            self.staged_bytes += nbytes

    def _unstage(self, nbytes: int) -> None:
        with self.staging:
            self.staged_bytes -= nbytes
            self.staging.notify_all()

    def _write_loop(self) -> None:
        if self.view is not None and self.view.is_cuda:
            torch.cuda.set_device(self.view.device)
        while True:
            item = self.jobs.get()
            if item is None:
                return
            try:
                if item[0] == "copied":
                    self._write_copied(*item[1:])
                else:
                    self._write_host(*item[1:])
                # drop this item's device rows and pinned buffers now, not when the next item arrives
                item = None
            except BaseException as e:  # surfaced on the engine's next step (get_finished raises)
                log.error("layertap: writing records failed: %r", e)
                self.error = e
                with self.staging:
                    self.staging.notify_all()
                return

    def _write_copied(self, group: list[SaveJob], hosts: list[torch.Tensor], reservations: list[Any], done: Any,
                      keep: Any, nbytes: int) -> None:
        """Wait for the records' host copies, then commit each. ``keep`` (the device rows and the index's
        pinned source) is only held: the copies read it until ``done``; the caller drops it afterwards."""
        try:
            done.synchronize()
        except BaseException:
            _abort(reservations)
            raise
        finally:
            self._unstage(nbytes)
        for i, (job, host, res) in enumerate(zip(group, hosts, reservations)):
            try:
                self._write_host(job, None if res is not None else host, res)
            except BaseException:
                _abort(reservations[i + 1:])
                raise

    def _write_host(self, job: SaveJob, host: torch.Tensor | None, res: Any) -> None:
        """Make one record visible: commit its reservation, or put its staged rows."""
        if res is not None:
            res.commit()  # the rows are in place: make the record visible
            return
        try:
            specs, meta = self._record_layout(job)
            tensors = {"token_ids": torch.empty(job.num_rows, dtype=torch.int64), "hidden_states": host}
            if "loss_mask" in specs:
                tensors["loss_mask"] = torch.empty(job.num_rows, dtype=torch.uint8)
            self._fill_small(tensors, job)
            if self.compact_cfg:
                from layertap.transport.compact import compact

                tensors, meta = compact(tensors, meta, **self.compact_cfg)
            self.sink.put(job.key, tensors, meta)
        except BaseException as e:
            log.error("layertap: writing record %s failed: %r", job.key, e)
            raise

    def close(self) -> None:
        if self.calls:
            log.info("layertap worker: %d records started in %d steps; layertap's per-step work took %.3f s "
                     "(%.3f ms per step)", self.saved, self.calls, self.busy_s, 1e3 * self.busy_s / self.calls)
            if self.saved and any(self.phase_s.values()):
                log.info("layertap worker: the record path per record (us): %s; other per-step work %.1f us per step",
                         ", ".join(f"{k} {1e6 * v / self.saved:.1f}" for k, v in self.phase_s.items()),
                         1e6 * (self.busy_s - sum(self.phase_s.values())) / self.calls)
        q = compat.QUIET_EMPTY_COUNTS
        if q["skipped"] or q["through"]:
            log.info("layertap worker: steps with no forward: %d skipped the connector round, %d went through it",
                     q["skipped"], q["through"])
        pool = getattr(self.sink, "pool", None)  # the engine's waits for the transport's lock (shm only)
        st = pool.lock_stats() if hasattr(pool, "lock_stats") else None
        if st and st["acquired"]:
            log.info("layertap worker: the pool lock was taken %d times, %d found held by the consumer; waited "
                     "%.2f ms in all, %.2f ms at most", st["acquired"], st["contended"], st["waited_ms"],
                     st["longest_wait_ms"])
        if self.writer is not None and self.writer.is_alive():
            self.jobs.put(None)
            self.writer.join(timeout=60)
        if self.rp is not None:  # it commits what it was handed, then exits; then its ring goes
            log.info("layertap worker: the record process took %d groups; the step waited for ring room %d times",
                     self.rp.sent, self.rp.waits)
            self.rp.close()
            self.rp, self.ring_t = None, None
        if self.pinned_region is not None:
            torch.cuda.synchronize()
            unregister_host(self.pinned_region)
            self.pinned_region = self.region_np = self.index_upload = None
        if self.sink is not None:
            self.sink.close()
