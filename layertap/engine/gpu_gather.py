"""Gathering captured rows off the GPU without stalling the forward stream. No vLLM import.

Stream discipline (the bug class peers shipped: capture indices allocated on the wrong stream):
  1. an event recorded on the *current* (forward) stream marks the rows as written; the side stream
     waits on it, so the gather never reads a row before the forward pass wrote it;
  2. the slot-index tensor is created *on the side stream* (``torch.cuda.stream(side)`` is active when it
     is allocated), so the caching allocator ties its memory to the side stream: it cannot be handed to a
     forward-stream allocation while the gather still reads it;
  3. rows go to pinned host memory with a non-blocking copy; the returned event completes when the host
     copy is done, and only then may the blocks be freed (the connector reports them then).
"""

from __future__ import annotations

from typing import Any

import torch

from layertap.engine.cache_view import ViewGeometry, gather_rows


def gather_to_host(view: torch.Tensor, geo: ViewGeometry, slots: torch.Tensor, side: "torch.cuda.Stream", *,
                   dst: torch.Tensor | None = None, **test_only: Any):
    """One record: ``gather_many_to_host`` with a single slot list; returns (host rows, event, keep-alive)."""
    hosts, done, keep = gather_many_to_host(view, geo, [slots], side, [dst], **test_only)
    return hosts[0], done, keep


def gather_many_to_host(view: torch.Tensor, geo: ViewGeometry, slot_lists: list[torch.Tensor],
                        side: "torch.cuda.Stream", dsts: list[torch.Tensor | None], *,
                        index_on_side_stream: bool = True, delay_cycles: int = 0):
    """Queue the gather of the records of one engine step on ``side``: one event pair, one index upload and
    one gather kernel for all of them, then one device-to-host copy per record. Returns (host rows per
    record, completion event, keep-alive).

    ``dsts[i]``: page-locked host memory to land record i in (e.g. a registered shared-memory slot, so the
    record needs no further copy); ``None``: a fresh pinned buffer. Per-record CUDA calls cost the worker's
    step thread ~1 ms per record on the H200 (events, pinned index buffer, upload, gather launches);
    batching them keeps capture off the engine's critical path. ``index_on_side_stream=False`` and
    ``delay_cycles`` exist only so a test can show what goes wrong with the index tensor on the wrong
    stream (the connector never passes them).
    """
    ready = torch.cuda.Event()
    ready.record()  # on the forward stream: everything queued so far, including the rows' writes
    side.wait_event(ready)
    host_slots = torch.cat(slot_lists).pin_memory()
    if index_on_side_stream:
        with torch.cuda.stream(side):
            dev_slots = host_slots.to(view.device, non_blocking=True)
    else:
        dev_slots = host_slots.to(view.device, non_blocking=True)  # WRONG: allocated on the forward stream
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        if delay_cycles:
            torch.cuda._sleep(delay_cycles)
        rows = gather_rows(view, geo, dev_slots)
        hosts, a = [], 0
        for slots, dst in zip(slot_lists, dsts):
            b = a + slots.shape[0]
            host = torch.empty((b - a, *rows.shape[1:]), dtype=rows.dtype, pin_memory=True) if dst is None else dst
            host.copy_(rows[a:b], non_blocking=True)
            hosts.append(host)
            a = b
    done = torch.cuda.Event()
    done.record(side)
    # The pinned source of the H2D copy and the device rows must outlive the copies; the caller holds
    # these until ``done``.
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
