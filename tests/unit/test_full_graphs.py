"""The hook path's FULL CUDA graphs (default; ``LAYERTAP_HOOK_FULL_GRAPHS=0`` turns them off, engine.compat): the capture
layer's backend declares UNIFORM_BATCH graph support, and slot checks that a graph replay skipped run after
the step against the slot mapping it used, or fail by name. (On the GPU: tests/gpu/test_gpu_capture.py's
``compiled`` and ``compiled-piecewise`` cases; the CPU build runs no CUDA graphs.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from layertap.engine import compat
from layertap.engine.record_writer import WorkerSide
from layertap.engine.saves import LayertapMetadata, SlotCheck, SlotCheckError


def test_backend_declares_uniform_batch_graphs():
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionBackend
    from vllm.v1.attention.backend import AttentionCGSupport

    b = compat.graphable_cache_only_backend()
    assert issubclass(b, CacheOnlyAttentionBackend) and b.get_impl_cls() is CacheOnlyAttentionBackend.get_impl_cls()
    assert b.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.UNIFORM_BATCH
    # vLLM's own stays as it was (NEVER): the change is layertap's layer only
    assert CacheOnlyAttentionBackend.get_builder_cls().get_cudagraph_support(None, None) == AttentionCGSupport.NEVER


def test_env_switch(monkeypatch):
    monkeypatch.delenv(compat.FULL_GRAPHS_ENV, raising=False)
    assert compat.hook_full_graphs()  # the default
    monkeypatch.setenv(compat.FULL_GRAPHS_ENV, "0")
    assert not compat.hook_full_graphs()
    monkeypatch.setenv(compat.FULL_GRAPHS_ENV, "1")
    assert compat.hook_full_graphs()


def _worker(block_size=4, blocks=8):
    w = object.__new__(WorkerSide)  # only what the slot checks read
    w.c = SimpleNamespace(_block_size=block_size)
    w.layer_name, w.num_manager_blocks, w.checked = "cap", blocks, 0
    return w


def test_unrun_checks_run_after_the_step(monkeypatch):
    w = _worker()
    meta = LayertapMetadata(checks=[SlotCheck("r1", [2], 0, 3)], num_tokens=4)  # block 2, positions 0-2: slots 8-10
    monkeypatch.setattr(compat, "step_slot_mapping",
                        lambda name, n: torch.tensor([8, 9, 10, -1])[:n] if name == "cap" else None)
    w.check_unrun(meta)
    assert w.checked == 1 and meta.checks == []
    w.check_unrun(meta)  # nothing left: a no-op
    assert w.checked == 1


def test_unrun_checks_fail_by_name(monkeypatch):
    w = _worker()
    monkeypatch.setattr(compat, "step_slot_mapping", lambda name, n: torch.tensor([8, 9]))
    with pytest.raises(SlotCheckError, match="request r1"):
        w.check_unrun(LayertapMetadata(checks=[SlotCheck("r1", [2], 0, 3)]))  # slot 10 was not written
    monkeypatch.setattr(compat, "step_slot_mapping", lambda name, n: None)
    with pytest.raises(SlotCheckError, match="did not run in this step's forward"):
        w.check_unrun(LayertapMetadata(checks=[SlotCheck("r1", [2], 0, 3)]))


def test_step_slot_mapping_reads_the_runners_buffer(monkeypatch):
    """Model Runner V2's persistent buffer: one row per KV-cache group, the step's tokens first; entries past
    them are from earlier steps and must not count as written."""
    buf = torch.tensor([[0, 1, 2, 3, 4], [8, 9, 10, 77, 78]])
    groups = [SimpleNamespace(layer_names=["model.layers.0.attn"]), SimpleNamespace(layer_names=["cap"])]
    runner = SimpleNamespace(block_tables=SimpleNamespace(slot_mappings=buf), kv_cache_config=SimpleNamespace(kv_cache_groups=groups))
    monkeypatch.setattr(compat, "_RUNNER", [lambda: runner])
    assert compat.step_slot_mapping("cap", 3).tolist() == [8, 9, 10]
    assert compat.step_slot_mapping("other", 3) is None
    monkeypatch.setattr(compat, "_RUNNER", [lambda: SimpleNamespace()])  # a runner that keeps no buffer: None
    assert compat.step_slot_mapping("cap", 3) is None


def test_decode_graph_mode_reads_vllms_resolved_mode(monkeypatch):
    from vllm.config import CUDAGraphMode

    def cfg(mode):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode))

    assert compat.decode_graph_mode(cfg(CUDAGraphMode.FULL_AND_PIECEWISE)) == "FULL"
    assert compat.decode_graph_mode(cfg(CUDAGraphMode.PIECEWISE)) == "PIECEWISE"
    assert compat.decode_graph_mode(cfg(CUDAGraphMode.NONE)) == "NONE"
    assert compat.decode_graph_mode(SimpleNamespace()) is None
    # the option wins over the environment
    monkeypatch.setenv(compat.FULL_GRAPHS_ENV, "0")
    assert compat.wants_full_graphs({"full_graphs": True}) and not compat.wants_full_graphs({})
    monkeypatch.setenv(compat.FULL_GRAPHS_ENV, "1")
    assert not compat.wants_full_graphs({"full_graphs": False}) and compat.wants_full_graphs({"full_graphs": None})
