"""Gathering captured rows off the GPU without stalling the forward stream. No vLLM import.

Stream discipline (the bug class peers shipped: capture indices allocated on the wrong stream):
  1. an event recorded on the *current* (forward) stream marks the rows as written; the gather stream
     waits on it, so the gather never reads a row before the forward pass wrote it;
  2. the slot-index tensor is created *on the gather stream* (``torch.cuda.stream(side)`` is active when
     it is allocated), so the caching allocator ties its memory to that stream: it cannot be handed to a
     forward-stream allocation while the gather still reads it;
  3. the gather copies the rows into a private device buffer, and the forward stream waits for that
     gather (a few microseconds), not for the host copy: from then on the next forward pass may rewrite
     the rows' cache blocks, so the engine can free them in the same step (``hold_forward``);
  4. the device-to-host copies run on a third stream from the private buffer into page-locked host
     memory; the returned event completes when they are done, and only then may the buffer and the host
     memory be reused (the caller keeps the returned keep-alive until then).
"""

from __future__ import annotations

from typing import Any

import torch

from layertap.engine.cache_view import ViewGeometry, gather_rows


def gather_to_host(view: torch.Tensor, geo: ViewGeometry, slots: torch.Tensor, side: "torch.cuda.Stream", *,
                   dst: torch.Tensor | None = None, **options: Any):
    """One record: ``gather_many_to_host`` with a single slot list; returns (host rows, event, keep-alive)."""
    hosts, done, keep = gather_many_to_host(view, geo, [slots], side, [dst], **options)
    return hosts[0], done, keep


def gather_many_to_host(view: torch.Tensor, geo: ViewGeometry, slot_lists: list[torch.Tensor],
                        side: "torch.cuda.Stream", dsts: list[torch.Tensor | None], *,
                        copy_stream: "torch.cuda.Stream | None" = None, hold_forward: bool = True,
                        index_on_side_stream: bool = True, delay_cycles: int = 0):
    """Queue the gather of the records of one engine step: one event, one index upload and one gather
    kernel for all of them on ``side``, then one device-to-host copy per record on ``copy_stream`` (default
    ``side``). Returns (host rows per record, completion event of the host copies, keep-alive).

    ``dsts[i]``: page-locked host memory to land record i in (e.g. a registered shared-memory slot, so the
    record needs no further copy); ``None``: a fresh pinned buffer. ``hold_forward``: the current stream
    waits for the gather kernel, so the rows' cache blocks may be reused by any work queued after this call
    (the connector then releases them at once); ``False`` leaves the current stream free and the caller
    must keep the blocks until the returned event. Per-record CUDA calls cost the worker's step thread ~1 ms
    per record on the H200 (events, pinned index buffer, upload, gather launches): batching them keeps
    capture off the engine's critical path. ``index_on_side_stream=False`` and ``delay_cycles`` exist only
    so a test can show what goes wrong with the index tensor on the wrong stream (the connector never
    passes them).
    """
    forward = torch.cuda.current_stream()
    ready = torch.cuda.Event()
    ready.record(forward)  # everything queued so far, including the rows' writes
    side.wait_event(ready)
    host_slots = torch.cat(slot_lists).pin_memory()
    if index_on_side_stream:
        with torch.cuda.stream(side):
            dev_slots = host_slots.to(view.device, non_blocking=True)
    else:
        dev_slots = host_slots.to(view.device, non_blocking=True)  # WRONG: allocated on the forward stream
        side.wait_stream(forward)
    with torch.cuda.stream(side):
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)
        rows = gather_rows(view, geo, dev_slots)  # a private copy: the cache blocks are no longer read
    gathered = torch.cuda.Event()
    gathered.record(side)
    if hold_forward:
        forward.wait_event(gathered)
    copy = copy_stream or side
    if copy is not side:
        copy.wait_event(gathered)
    with torch.cuda.stream(copy):
        hosts, a = [], 0
        for slots, dst in zip(slot_lists, dsts):
            b = a + slots.shape[0]
            host = torch.empty((b - a, *rows.shape[1:]), dtype=rows.dtype, pin_memory=True) if dst is None else dst
            host.copy_(rows[a:b], non_blocking=True)
            hosts.append(host)
            a = b
    done = torch.cuda.Event()
    done.record(copy)
    # The pinned source of the upload and the device rows must outlive the copies; the caller holds these
    # until ``done``.
    return hosts, done, (host_slots, rows)


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
