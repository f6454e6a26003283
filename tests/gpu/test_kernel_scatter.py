"""The hook's kernel scatter (vLLM's ``reshape_and_cache_flash``, one launch per two planes) writes exactly
what ``cache_view.scatter_planes`` (the torch path, proven on the CPU) writes, on both view layouts, with
an odd plane count, padded planes, a shorter slot mapping and padding slots; and its first-forward self
check raises by name when the kernel put other values."""

import pytest
import torch

from layertap.engine.cache_view import CacheLayoutError, gather_rows, scatter_planes, view_geometry
from layertap.engine.compat import KernelScatter


@pytest.fixture(scope="module", autouse=True)
def ops():
    import importlib

    importlib.import_module("vllm._custom_ops")


def make_view(plane_axis, blocks=12, bs=16, planes=4, hidden=256, dtype=torch.bfloat16):
    shape = (blocks, planes, bs, hidden) if plane_axis == 1 else (blocks, bs, planes, hidden)
    return torch.zeros(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("plane_axis", [1, 2])
@pytest.mark.parametrize("planes", [3, 4])
def test_kernel_scatter_writes_what_the_torch_scatter_writes(plane_axis, planes):
    g = torch.Generator(device="cuda").manual_seed(plane_axis * 10 + planes)
    bs, hidden = 16, 256
    a, b = make_view(plane_axis, planes=planes), make_view(plane_axis, planes=planes)
    geo = view_geometry(tuple(a.shape), planes, hidden, plane_axis=plane_axis)
    # 40 tokens, padded to 48 rows (the model's input is padded for graphs), slots shorter than the rows,
    # two padding slots (-1), slots spread over blocks 1.. (block 0 is vLLM's null block)
    slots = torch.randperm(11 * bs, generator=g, device="cuda")[:40] + bs
    slots[[7, 31]] = -1
    rows = [torch.randn(48, hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in range(planes)]
    scatter_planes(a, geo, slots, rows)
    k = KernelScatter(b, geo)
    k(slots, rows)
    valid = slots[slots >= 0]
    assert torch.equal(gather_rows(b, geo, valid), gather_rows(a, geo, valid))
    assert torch.equal(b[1:], a[1:])  # nothing else written (the torch path sends padding to block 0)
    assert not torch.any(b[0] != 0), "the kernel wrote padding slots"
    # the self check ran on a forward with padding: not yet; a forward with only distinct valid slots checks
    assert not k.checked
    k(valid, [r[: valid.numel()] for r in rows])
    assert k.checked


def test_kernel_scatter_self_check_names_a_wrong_write():
    view = make_view(2)
    k = KernelScatter(view, view_geometry(tuple(view.shape), 4, 256, plane_axis=2))
    real = k.op

    def wrong(key, value, kc, vc, slots, dtype, ks, vs):  # writes the key plane's rows negated
        real(-key, value, kc, vc, slots, dtype, ks, vs)

    k.op = wrong
    slots = torch.arange(16, 48, device="cuda")
    rows = [torch.randn(32, 256, device="cuda").to(torch.bfloat16) for _ in range(4)]
    with pytest.raises(CacheLayoutError, match="reshape_and_cache_flash"):
        k(slots, rows)
