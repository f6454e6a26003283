"""CUDA-stream safety of the gather (no vLLM needed): the rows' writes are ordered before the gather, the
slot-index tensor lives on the gather stream, and the forward stream may rewrite the rows' blocks right
after the call (it waits for the gather, not for the host copy). Each property has a control that
demonstrably reads wrong rows without it, so these tests would catch a regression of the connector's
stream discipline."""

import torch

from layertap.engine.cache_view import slots_for, view_geometry
from layertap.engine.gpu_gather import gather_many_to_host

PLANES, HIDDEN, BS, BLOCKS = 3, 256, 16, 64
DELAY = 200_000_000  # GPU cycles the side stream sleeps before gathering (~0.1 s)
MINE, OTHER = list(range(0, 32)), list(range(32, 64))  # two requests' cache blocks
N = 32 * BS - 5  # rows of each (the last block partly filled)


def gather_to_host(view, geo, blocks, side, **options):
    """One record (the connector's call with a single block list)."""
    hosts, done, keep = gather_many_to_host(view, geo, [blocks], [N], side, [None], **options)
    return hosts[0], done, keep


def setup():
    torch.manual_seed(0)
    view = torch.zeros(BLOCKS, PLANES, BS, HIDDEN, device="cuda")
    geo = view_geometry(tuple(view.shape), PLANES, HIDDEN, plane_axis=1)
    mine = slots_for(MINE, BS, 0, N)
    other = slots_for(OTHER, BS, 0, N)
    a = torch.randn(mine.numel(), PLANES, HIDDEN, device="cuda")
    b = torch.randn(other.numel(), PLANES, HIDDEN, device="cuda")
    view[(mine // BS).cuda(), :, (mine % BS).cuda()] = a
    view[(other // BS).cuda(), :, (other % BS).cuda()] = b
    torch.cuda.synchronize()
    return view, geo, mine, other, a, b


def adversary():
    """What the forward stream does next: allocate a same-size int64 tensor and fill it (with valid block ids
    of another request). If the allocator hands it the gather's index memory, the gather reads wrong rows."""
    t = torch.empty(len(OTHER), dtype=torch.int64, device="cuda")
    t.copy_(torch.tensor(OTHER).cuda(non_blocking=False))
    return t


def test_gather_waits_for_the_forward_streams_writes():
    view, geo, mine, _, a, _ = setup()
    side = torch.cuda.Stream()
    fresh = torch.randn_like(a)
    torch.cuda._sleep(DELAY)  # forward stream busy, then it writes new rows
    view[(mine // BS).cuda(), :, (mine % BS).cuda()] = fresh
    host, done, _keep = gather_to_host(view, geo, MINE, side)
    done.synchronize()
    assert torch.equal(host, fresh.cpu())


def test_batched_gather_waits_for_writes_and_splits_records_right():
    """The connector's per-step path: several records in one gather, one into a given host buffer."""
    view, geo, mine, other, a, b = setup()
    side = torch.cuda.Stream()
    fresh = torch.randn_like(a)
    torch.cuda._sleep(DELAY)
    view[(mine // BS).cuda(), :, (mine % BS).cuda()] = fresh
    dst = torch.empty(other.numel(), PLANES, HIDDEN, pin_memory=True)
    hosts, done, _keep = gather_many_to_host(view, geo, [MINE, OTHER[:1], OTHER], [N, 7, N], side, [None, None, dst])
    junk = adversary()
    done.synchronize()
    del junk
    assert torch.equal(hosts[0], fresh.cpu()) and torch.equal(hosts[1], b[:7].cpu())
    assert hosts[2] is dst and torch.equal(dst, b.cpu())


def test_index_tensor_on_side_stream_survives_allocator_reuse():
    view, geo, mine, other, a, _ = setup()
    side = torch.cuda.Stream()
    host, done, _keep = gather_to_host(view, geo, MINE, side, delay_cycles=DELAY, hold_forward=False)
    junk = adversary()
    done.synchronize()
    del junk
    assert torch.equal(host, a.cpu())


def test_wrong_stream_index_tensor_reads_another_requests_rows():
    """The control: the same adversary against an index tensor allocated on the forward stream."""
    view, geo, mine, other, a, b = setup()
    side = torch.cuda.Stream()
    host, done, _keep = gather_to_host(view, geo, MINE, side, index_on_side_stream=False, delay_cycles=DELAY,
                                       hold_forward=False)
    junk = adversary()
    done.synchronize()
    del junk
    assert not torch.equal(host, a.cpu()), "allocator reuse did not happen; the control proves nothing"
    assert torch.equal(host, b.cpu())  # exactly the other request's rows: the silent bug peers shipped


def _rewrite_blocks_after_gather(hold_forward: bool):
    """The gather is slow (its stream sleeps first); right after the call, the forward stream rewrites the
    record's cache blocks, as the next request given those freed blocks would."""
    view, geo, mine, _, a, _ = setup()
    side, copy = torch.cuda.Stream(), torch.cuda.Stream()
    dst = torch.empty(mine.numel(), PLANES, HIDDEN, pin_memory=True)
    hosts, done, _keep = gather_many_to_host(view, geo, [MINE], [N], side, [dst], copy_stream=copy,
                                             hold_forward=hold_forward, delay_cycles=DELAY)
    junk = torch.full_like(a, 7.0)
    view[(mine // BS).cuda(), :, (mine % BS).cuda()] = junk
    done.synchronize()
    return hosts[0], a, junk


def test_blocks_can_be_reused_right_after_the_gather():
    host, a, _ = _rewrite_blocks_after_gather(hold_forward=True)
    assert torch.equal(host, a.cpu())


def test_without_holding_the_forward_stream_reused_blocks_corrupt_the_record():
    """The control: without the forward stream waiting for the gather, the rewrite lands first."""
    host, a, junk = _rewrite_blocks_after_gather(hold_forward=False)
    assert not torch.equal(host, a.cpu()), "the rewrite did not overtake the gather; the control proves nothing"
    assert torch.equal(host, junk.cpu())
