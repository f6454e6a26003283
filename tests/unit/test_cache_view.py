"""Exhaustive tests of the pure slot / group / axis arithmetic (no engine)."""

import itertools

import pytest
import torch

from layertap.engine.cache_view import (
    scatter_planes,
    BlockCoverageError,
    CacheLayoutError,
    GroupInfo,
    find_hidden_group,
    gather_blocks,
    gather_rows,
    kernel_ratio,
    slots_for,
    view_blocks_for,
    view_geometry,
    view_index,
)

CAP = "model.cache_only_layers.4"
ATTN = tuple(f"model.layers.{i}.self_attn.attn" for i in range(4))


def test_group_own_spec_wins():
    groups = [GroupInfo("SlidingWindowSpec", ATTN, 32), GroupInfo("HiddenStateCacheSpec", (CAP,), 16)]
    assert find_hidden_group(groups) == 1
    assert find_hidden_group(groups[::-1]) == 0


def test_group_merged_by_layer_spec_types_worker_side():
    merged = GroupInfo("UniformTypeKVCacheSpecs", ATTN + (CAP,), 128,
                       ("FullAttentionSpec",) * 4 + ("HiddenStateCacheSpec",))
    other = GroupInfo("SlidingWindowSpec", ("x",), 128)
    assert find_hidden_group([other, merged]) == 1


def test_group_merged_by_layer_name_scheduler_side():
    # The scheduler's flattened copy: a representative spec, but layer names are still there.
    merged = GroupInfo("FullAttentionSpec", ATTN + (CAP,), 128)
    assert find_hidden_group([merged]) == 0
    assert find_hidden_group([GroupInfo("A", ("x",), 16), merged], capture_layer=CAP) == 1


def test_group_single_group_means_zero():
    assert find_hidden_group([GroupInfo("FullAttentionSpec", ATTN, 16)]) == 0


@pytest.mark.parametrize("groups", [
    [GroupInfo("FullAttentionSpec", ATTN, 16), GroupInfo("SlidingWindowSpec", ("y",), 16)],
    [GroupInfo("HiddenStateCacheSpec", (CAP,), 16), GroupInfo("HiddenStateCacheSpec", ("z",), 16)],
])
def test_group_ambiguous_raises_naming_groups(groups):
    with pytest.raises(CacheLayoutError, match="group 0: .*group 1:"):
        find_hidden_group(groups)


def test_geometry_plane_axis_by_capture_count():
    g = view_geometry((10, 3, 16, 64), n_planes=3, hidden=64)
    assert (g.plane_axis, g.offset_axis, g.view_block_size, g.num_blocks) == (1, 2, 16, 10)
    g = view_geometry((10, 16, 3, 64), n_planes=3, hidden=64)
    assert (g.plane_axis, g.offset_axis, g.view_block_size) == (2, 1, 16)


def test_geometry_version_hint_wins_and_mismatch_raises():
    # 0.25 writes [blocks, block_size, planes, hidden]; with 16 planes and block size 16 only the hint can tell.
    assert view_geometry((10, 16, 16, 64), 16, 64, plane_axis=2).plane_axis == 2
    assert view_geometry((10, 16, 16, 64), 16, 64, plane_axis=1).plane_axis == 1
    with pytest.raises(CacheLayoutError, match="both middle axes"):
        view_geometry((10, 16, 16, 64), 16, 64)
    with pytest.raises(CacheLayoutError, match="layout changed"):
        view_geometry((10, 3, 16, 64), 3, 64, plane_axis=2)


@pytest.mark.parametrize("shape,planes,hidden,msg", [
    ((10, 3, 16, 32), 3, 64, "hidden size"),
    ((10, 4, 16, 64), 3, 64, "no axis matches"),
    ((10, 3, 64), 3, 64, "dims"),
])
def test_geometry_errors(shape, planes, hidden, msg):
    with pytest.raises(CacheLayoutError, match=msg):
        view_geometry(shape, planes, hidden)


def test_kernel_ratio():
    assert kernel_ratio(128, 128) == 1
    assert kernel_ratio(128, 32) == 4
    with pytest.raises(CacheLayoutError):
        kernel_ratio(48, 32)


@pytest.mark.parametrize("bs", [1, 4, 16, 128])
def test_slots_for_every_range(bs):
    blocks = [7, 2, 9, 0, 5]
    for start in range(0, len(blocks) * bs, max(1, bs // 2)):
        for stop in range(start, len(blocks) * bs + 1, max(1, bs // 3)):
            s = slots_for(blocks, bs, start, stop)
            want = [blocks[p // bs] * bs + p % bs for p in range(start, stop)]
            assert s.tolist() == want


def test_slots_coverage_errors_name_request():
    with pytest.raises(BlockCoverageError, match="req-7.*33 tokens need 3 blocks.*holds 2"):
        slots_for([1, 2], 16, 0, 33, request="req-7")
    with pytest.raises(BlockCoverageError, match="req-8.*past the cache of 4"):
        slots_for([1, 4], 16, 0, 20, request="req-8", num_manager_blocks=4)


def _physical_cache(num_blocks, planes, bs, hidden, layout):
    """A logical [blocks, planes, bs, hidden] view over storage in a permuted physical order, as vLLM's
    as_strided views are (the capture code must index through logical axes only)."""
    if layout == "NHD":  # physical [blocks, bs, planes, hidden]
        phys = torch.zeros(num_blocks, bs, planes, hidden)
        return phys.permute(0, 2, 1, 3)
    phys = torch.zeros(num_blocks, planes, bs, hidden)  # HND: contiguous logical order
    return phys


def _write_like_vllm(view, slots, rows, view_bs):
    # vLLM's basic_cache indexes by the *view's* block size.
    view[slots // view_bs, :, slots % view_bs] = rows


@pytest.mark.parametrize("layout,manager_bs,kernel_bs", list(itertools.product(["HND", "NHD"], [16, 64], [16, 8, 4])))
def test_gather_roundtrip_with_kernel_split_and_layouts(layout, manager_bs, kernel_bs):
    torch.manual_seed(0)
    planes, hidden, n_mgr_blocks = 3, 8, 6
    ratio = kernel_ratio(manager_bs, kernel_bs)
    view = _physical_cache(n_mgr_blocks * ratio, planes, kernel_bs, hidden, layout)
    geo = view_geometry(tuple(view.shape), planes, hidden)
    # Two requests interleaved over the block pool.
    reqs = {"a": [5, 1, 3], "b": [0, 4, 2]}
    truth = {}
    for name, blocks in reqs.items():
        n = len(blocks) * manager_bs - 3
        rows = torch.randn(n, planes, hidden)
        slots = slots_for(blocks, manager_bs, 0, n)
        _write_like_vllm(view, slots, rows, kernel_bs)
        truth[name] = rows
    for name, blocks in reqs.items():
        n = truth[name].shape[0]
        got = gather_rows(view, geo, slots_for(blocks, manager_bs, 0, n, num_manager_blocks=n_mgr_blocks))
        assert torch.equal(got, truth[name])
        # the connector's path: one index per view block, the record's rows a prefix of the blocks' rows
        vblocks = view_blocks_for(blocks, manager_bs, n, ratio, num_manager_blocks=n_mgr_blocks)
        assert len(vblocks) == len(blocks) * ratio
        assert torch.equal(gather_blocks(view, geo, torch.tensor(vblocks))[:n], truth[name])


def test_view_blocks_for_counts_blocks_and_names_the_request():
    assert view_blocks_for([7, 2, 9], 16, 17, 1) == [7, 2]  # 17 rows need 2 blocks of 16
    assert view_blocks_for([7, 2, 9], 16, 16, 4) == [28, 29, 30, 31]  # kernel blocks of 4 inside block 7
    assert view_blocks_for([7], 16, 0, 1) == []
    with pytest.raises(BlockCoverageError, match="req-7.*33 tokens need 3 blocks.*holds 2"):
        view_blocks_for([1, 2], 16, 33, 1, request="req-7")
    with pytest.raises(BlockCoverageError, match="req-8.*past the cache of 4"):
        view_blocks_for([1, 4], 16, 20, 1, request="req-8", num_manager_blocks=4)


def test_gather_with_swapped_middle_axes():
    planes, hidden, bs = 2, 4, 8
    view = torch.zeros(3, bs, planes, hidden)  # [blocks, offset, planes, hidden]
    geo = view_geometry(tuple(view.shape), planes, hidden)
    rows = torch.randn(10, planes, hidden)
    slots = slots_for([2, 0], bs, 0, 10)
    blk, off = view_index(slots, bs)
    view[blk, off] = rows
    assert torch.equal(gather_rows(view, geo, slots), rows)


def test_block_size_from_view_would_be_wrong():
    """Regression guard for the classic bug: multiplying block ids by the view's (kernel) block size."""
    manager_bs, kernel_bs = 32, 16
    blocks = [3, 1]
    right = slots_for(blocks, manager_bs, 0, 40)
    wrong = slots_for(blocks, kernel_bs, 0, 32)
    assert right[:32].tolist() != wrong.tolist()


@pytest.mark.parametrize("plane_axis", [1, 2])
def test_scatter_planes_is_the_inverse_of_gather_rows_and_drops_padding(plane_axis):
    """The hook path writes each captured layer's rows by slot; reading by the same slots returns them, in
    both layouts, including a kernel block size smaller than the manager's; padding (-1) goes to block 0."""
    planes, hidden, view_bs, blocks = 3, 8, 4, 10
    shape = (blocks, planes, view_bs, hidden) if plane_axis == 1 else (blocks, view_bs, planes, hidden)
    view = torch.zeros(shape)
    geo = view_geometry(shape, planes, hidden, plane_axis=plane_axis)
    slots = slots_for([3, 1, 4], 8, 0, 21)  # manager block size 8 = 2 kernel blocks of 4
    rows = [torch.randn(len(slots) + 2, hidden) for _ in range(planes)]  # the model input is padded by 2
    padded = torch.cat([slots, torch.tensor([-1, -1])])
    scatter_planes(view, geo, padded[: len(slots) + 1], rows)
    got = gather_rows(view, geo, slots)
    assert torch.equal(got, torch.stack([r[: len(slots)] for r in rows], dim=1))
    # the padding row went to block 0, which no request owns; every other block untouched
    owned = {int(s) // view_bs for s in slots}
    for b in range(blocks):
        blk = view[b]
        if b not in owned and b != 0:
            assert not blk.any()
    with pytest.raises(CacheLayoutError, match="planes"):
        scatter_planes(view, geo, slots, rows[:2])
