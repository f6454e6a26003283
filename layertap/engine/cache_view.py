"""Pure arithmetic of reading captured rows out of vLLM's KV cache. No vLLM import.

Every bug class the field has shipped lives here, so each function takes plain ints and tensors and is
unit-tested exhaustively (``tests/unit/test_cache_view.py``); the engine tests then prove the wiring.

Terms:
    manager block size  the block size of the hidden-state KV-cache *group spec* (what block ids count)
    view                the per-layer tensor vLLM binds to the capture layer: logical 4-D
                        ``[num_blocks, n_planes, block_size, hidden]`` (physical order may differ: index
                        through logical axes only, never ``.view()``)
    view block size     ``view.shape[2]``; smaller than the manager block size when vLLM splits a manager
                        block into kernel blocks (then ``view.shape[0]`` grows by the same factor)
    slot                ``block_id * manager_block_size + offset``: a token position's cell in the cache
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

HIDDEN_SPEC = "HiddenStateCacheSpec"
CAPTURE_LAYER_MARK = "cache_only_layers."


class CacheLayoutError(RuntimeError):
    """The KV cache does not look the way the capture arithmetic needs; names what differs."""


class BlockCoverageError(RuntimeError):
    """A request's block ids cannot hold its tokens, or point past the cache; names the request."""


@dataclass(frozen=True)
class GroupInfo:
    """What the lookup needs to know about one KV-cache group."""

    spec_type: str
    """Class name of the group's spec (``HiddenStateCacheSpec``, ``UniformTypeKVCacheSpecs``, ...)."""
    layer_names: tuple[str, ...]
    block_size: int
    layer_spec_types: tuple[str, ...] = ()
    """Per-layer spec class names when the group spec carries them (worker side), else empty."""


def find_hidden_group(groups: Sequence[GroupInfo], capture_layer: str | None = None) -> int:
    """Index of the KV-cache group that holds the capture layer.

    Recognised shapes, in order: a group whose spec *is* the hidden-state spec (own group); a merged
    group whose per-layer specs include one, or whose layer names include the capture layer (vLLM
    merges it into the single attention group of uniform full-attention models); a config with exactly
    one group (the scheduler's flattened copy). Anything else raises, naming the groups.
    """
    own = [i for i, g in enumerate(groups) if g.spec_type == HIDDEN_SPEC]
    if len(own) == 1:
        return own[0]
    merged = [
        i for i, g in enumerate(groups)
        if HIDDEN_SPEC in g.layer_spec_types
        or (capture_layer is not None and capture_layer in g.layer_names)
        or (capture_layer is None and any(CAPTURE_LAYER_MARK in n for n in g.layer_names))
    ]
    if len(own) == 0 and len(merged) == 1:
        return merged[0]
    if len(own) == 0 and len(merged) == 0 and len(groups) == 1:
        return 0
    desc = "; ".join(f"group {i}: {g.spec_type} block_size={g.block_size} layers={list(g.layer_names)[:4]}"
                     f"{'...' if len(g.layer_names) > 4 else ''}" for i, g in enumerate(groups))
    raise CacheLayoutError(
        f"cannot identify the hidden-state KV-cache group among {len(groups)} groups "
        f"(own-spec matches {own}, layer matches {merged}): {desc}"
    )


@dataclass(frozen=True)
class ViewGeometry:
    """Where things are in the capture layer's logical 4-D view."""

    num_blocks: int
    view_block_size: int
    n_planes: int
    hidden: int
    plane_axis: int
    offset_axis: int


def view_geometry(shape: Sequence[int], n_planes: int, hidden: int, plane_axis: int | None = None) -> ViewGeometry:
    """Identify the axes of the capture layer's view by matching the configured capture count.

    The view is ``[num_blocks, n_planes, block_size, hidden]`` (vLLM 0.32) or ``[num_blocks, block_size,
    n_planes, hidden]`` (vLLM 0.25). ``plane_axis`` is what the running vLLM version writes (from
    ``compat``); the axis at that position must have the capture count, else this raises (a layout change
    read as the wrong axis is silent garbage). Without a hint the axis is found by size, and a tie raises.
    """
    if len(shape) != 4:
        raise CacheLayoutError(f"capture view has {len(shape)} dims {tuple(shape)}; expected 4 "
                               "[num_blocks, n_planes, block_size, hidden] or [num_blocks, block_size, n_planes, hidden]")
    if shape[3] != hidden:
        raise CacheLayoutError(f"capture view {tuple(shape)}: last axis {shape[3]} != model hidden size {hidden}")
    matches = [a for a in (1, 2) if shape[a] == n_planes]
    if plane_axis is not None:
        if plane_axis not in (1, 2) or shape[plane_axis] != n_planes:
            raise CacheLayoutError(f"capture view {tuple(shape)}: this vLLM writes planes on axis {plane_axis}, but "
                                   f"that axis does not have the {n_planes} captured layers (layout changed?)")
    elif len(matches) == 1:
        plane_axis = matches[0]
    elif not matches:
        raise CacheLayoutError(f"capture view {tuple(shape)}: no axis matches the {n_planes} captured layers")
    else:
        raise CacheLayoutError(f"capture view {tuple(shape)}: both middle axes equal the capture count {n_planes}; "
                               "the plane axis must be given")
    offset_axis = 3 - plane_axis
    return ViewGeometry(num_blocks=int(shape[0]), view_block_size=int(shape[offset_axis]), n_planes=n_planes,
                        hidden=hidden, plane_axis=plane_axis, offset_axis=offset_axis)


def kernel_ratio(manager_block_size: int, view_block_size: int) -> int:
    """How many view (kernel) blocks one manager block spans; raises unless it divides evenly."""
    if view_block_size <= 0 or manager_block_size % view_block_size:
        raise CacheLayoutError(f"manager block size {manager_block_size} is not a multiple of the view's block "
                               f"size {view_block_size}")
    return manager_block_size // view_block_size


def slots_for(block_ids: Sequence[int], manager_block_size: int, start: int, stop: int, *,
              request: str = "?", num_manager_blocks: int | None = None) -> torch.Tensor:
    """Slots of token positions ``[start, stop)`` of a request with these block ids (int64 tensor).

    Raises ``BlockCoverageError`` naming the request when the blocks cannot cover the positions or a
    block id is outside the cache.
    """
    if not 0 <= start <= stop:
        raise BlockCoverageError(f"request {request}: bad token range [{start}, {stop})")
    need = -(-stop // manager_block_size) if stop else 0
    if need > len(block_ids):
        raise BlockCoverageError(
            f"request {request}: {stop} tokens need {need} blocks of {manager_block_size}, "
            f"but it holds {len(block_ids)} block ids"
        )
    blocks = torch.as_tensor(list(block_ids[:need]), dtype=torch.int64)
    if num_manager_blocks is not None and need and (int(blocks.max()) >= num_manager_blocks or int(blocks.min()) < 0):
        raise BlockCoverageError(
            f"request {request}: block ids {blocks.tolist()[:8]} run past the cache of {num_manager_blocks} blocks"
        )
    pos = torch.arange(start, stop, dtype=torch.int64)
    return blocks[pos // manager_block_size] * manager_block_size + pos % manager_block_size


def view_blocks_for(block_ids: Sequence[int], manager_block_size: int, num_rows: int, ratio: int, *,
                    request: str = "?", num_manager_blocks: int | None = None) -> list[int]:
    """View (kernel) block ids holding token positions ``[0, num_rows)`` of a request, in order: the rows
    are the first ``num_rows`` rows of these blocks laid end to end. Plain ints, no tensor work (this runs
    on the engine's step thread for every record). Raises ``BlockCoverageError`` like ``slots_for``."""
    need = -(-num_rows // manager_block_size) if num_rows > 0 else 0
    if num_rows < 0 or need > len(block_ids):
        raise BlockCoverageError(
            f"request {request}: {num_rows} tokens need {need} blocks of {manager_block_size}, "
            f"but it holds {len(block_ids)} block ids"
        )
    mine = list(block_ids[:need])
    if num_manager_blocks is not None and mine and (max(mine) >= num_manager_blocks or min(mine) < 0):
        raise BlockCoverageError(
            f"request {request}: block ids {mine[:8]} run past the cache of {num_manager_blocks} blocks"
        )
    if ratio == 1:
        return mine
    return [b * ratio + j for b in mine for j in range(ratio)]


def gather_blocks(view: torch.Tensor, geo: ViewGeometry, view_blocks: torch.Tensor) -> torch.Tensor:
    """Every row of these view blocks, ``[len(view_blocks) * view_block_size, n_planes, hidden]``, in block
    order (a private copy). One index per block instead of one per token: ``view_blocks_for`` gives the
    blocks of a record, whose rows are then a prefix of the result."""
    # [B, block, planes, hidden] (plane axis 2) or [B, planes, block, hidden] (axis 1); index_select, not
    # view[idx]: the same kernel, less dispatch on the engine's step thread (29 against 36 us on the H200 host)
    got = torch.index_select(view, 0, view_blocks)
    if geo.plane_axis == 1:
        got = got.transpose(1, 2)
    return got.reshape(-1, geo.n_planes, geo.hidden)


def view_index(slots: torch.Tensor, view_block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(view block, offset within it) of each slot: the view's block dimension, never the manager's."""
    return slots // view_block_size, slots % view_block_size


def gather_rows(view: torch.Tensor, geo: ViewGeometry, slots: torch.Tensor) -> torch.Tensor:
    """Rows ``[len(slots), n_planes, hidden]`` for the given slots, through logical axes only."""
    blk, off = view_index(slots, geo.view_block_size)
    if geo.plane_axis == 1:
        return view[blk, :, off]  # advanced indices on axes 0 and 2 -> [T, n_planes, hidden]
    return view[blk, off]  # [num_blocks, block, planes, hidden] -> [T, n_planes, hidden]


def check_planes(geo: ViewGeometry, slots: torch.Tensor, planes: Sequence[torch.Tensor]) -> None:
    """Raise ``CacheLayoutError`` unless there is one plane per captured layer, each with a row per slot."""
    if len(planes) != geo.n_planes:
        raise CacheLayoutError(f"{len(planes)} hidden-state planes for a view of {geo.n_planes}")
    n = slots.shape[0]
    for p, rows in enumerate(planes):
        if rows.shape[0] < n:
            raise CacheLayoutError(f"plane {p} has {rows.shape[0]} rows for {n} slots")


def scatter_planes(view: torch.Tensor, geo: ViewGeometry, slots: torch.Tensor, planes: Sequence[torch.Tensor]) -> None:
    """Write one row per slot into each plane of the view: ``planes[p][i]`` lands at ``slots[i]``.

    The inverse of ``gather_rows``, used by the hook capture path inside the model runner's forward.
    ``slots`` may be shorter than the planes (vLLM pads the model's input but not always the slot
    mapping); rows past it are padding and are not written. Padding slots (-1) are sent to block 0, which
    vLLM never hands to a request (its null block), so the write needs no branch and no host sync.
    """
    check_planes(geo, slots, planes)
    n = slots.shape[0]
    blk, off = view_index(slots.clamp_min(0), geo.view_block_size)
    # One write for all planes (this runs on the engine's step thread every forward: few kernel launches)
    stacked = torch.stack([rows[:n] for rows in planes], dim=1)  # [n, planes, hidden]
    if geo.plane_axis == 1:
        view[blk, :, off] = stacked  # advanced indices around a slice: the indexed shape is [n, planes, hidden]
    else:
        view[blk, off] = stacked
