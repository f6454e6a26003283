"""Per-function wall time inside every process of a vLLM engine, for ``benchmarks/step_profile.py``.

Active only where ``LAYERTAP_STEP_TIMER`` names a directory (this folder is put first on ``PYTHONPATH`` by
step_profile.py, so spawned engine processes load it at start-up). When a module in ``TARGETS`` is imported,
the listed functions are wrapped with two clock reads (~0.3 us a call, the same in every variant: a deterministic
count, not a sample). On ``SIGNAL`` each process writes its counters to ``$LAYERTAP_STEP_TIMER/<pid>.<n>.json``
(n counts the dumps); step_profile.py signals after the warm-up and after the measured requests and takes the
difference. Names that do not exist in this vLLM are skipped (both the CUDA 0.25 and the CPU 0.32 names are
listed)."""

from __future__ import annotations

import os

_DIR = os.environ.get("LAYERTAP_STEP_TIMER")

TARGETS: dict[str, list[str]] = {
    "vllm.v1.engine.core": ["EngineCore.step", "EngineCore.step_with_batch_queue", "EngineCore.add_request",
                            "EngineCoreProc._process_input_queue", "EngineCoreProc._process_engine_step",
                            "EngineCoreProc._handle_client_request"],
    "vllm.v1.core.sched.scheduler": ["Scheduler.schedule", "Scheduler.update_from_output", "Scheduler.add_request",
                                     "Scheduler._free_request", "Scheduler._connector_finished",
                                     "Scheduler._update_from_kv_xfer_finished", "Scheduler.finish_requests",
                                     "Scheduler._update_after_schedule", "Scheduler._make_cached_request_data"],
    "vllm.v1.core.kv_cache_manager": ["KVCacheManager.allocate_slots", "KVCacheManager.get_computed_blocks",
                                      "KVCacheManager.free", "KVCacheManager.get_blocks"],
    "vllm.v1.core.kv_cache_coordinator": ["KVCacheCoordinator.allocate_new_blocks", "KVCacheCoordinator.free",
                                          "KVCacheCoordinator.get_num_blocks_to_allocate"],
    "vllm.v1.worker.gpu.model_runner": ["GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens",
                                        "GPUModelRunner.prepare_inputs", "GPUModelRunner.prepare_attn",
                                        "GPUModelRunner.add_requests", "GPUModelRunner.update_requests",
                                        "GPUModelRunner.finish_requests", "GPUModelRunner.sample",
                                        "GPUModelRunner.postprocess_sampled", "GPUModelRunner.free_states"],
    "vllm.v1.worker.gpu.kv_connector": ["ActiveKVConnector.pre_forward", "ActiveKVConnector.post_forward",
                                        "ActiveKVConnector.no_forward"],
    "vllm.v1.worker.gpu.attn_utils": ["build_attn_metadata"],
    "vllm.v1.worker.gpu.block_table": ["BlockTables.apply_staged_writes", "BlockTables.gather_block_tables",
                                       "BlockTables.compute_slot_mappings", "BlockTables.append_block_ids"],
    "vllm.v1.worker.gpu.async_utils": ["AsyncOutput.__init__", "AsyncOutput.get_output"],
    "vllm.v1.worker.gpu_model_runner": ["GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens",
                                        "GPUModelRunner._update_states", "GPUModelRunner._prepare_inputs",
                                        "GPUModelRunner._build_attention_metadata", "GPUModelRunner._model_forward",
                                        "GPUModelRunner._preprocess", "GPUModelRunner._sample",
                                        "GPUModelRunner._bookkeeping_sync"],
    "vllm.v1.executor.uniproc_executor": ["UniProcExecutor.execute_model", "UniProcExecutor.sample_tokens"],
    "vllm.v1.executor.multiproc_executor": ["MultiprocExecutor.execute_model", "MultiprocExecutor.sample_tokens"],
    "vllm.model_executor.models.qwen3": ["Qwen3ForCausalLM.forward", "Qwen3ForCausalLM.compute_logits"],
    "vllm.model_executor.models.extract_hidden_states": ["dummy_attention",
                                                         "CacheOnlyAttentionMetadataBuilder.build"],
    "vllm.v1.attention.backends.flash_attn": ["FlashAttentionMetadataBuilder.build"],
    "layertap.engine.connector": ["LayertapConnector.build_connector_meta", "LayertapConnector.get_finished",
                                  "LayertapConnector.request_finished_all_groups", "LayertapConnector.wait_for_save",
                                  "LayertapConnector.has_connector_metadata", "LayertapConnector.save_kv_layer",
                                  "LayertapConnector.start_load_kv", "LayertapConnector.update_state_after_alloc",
                                  "LayertapConnector.get_num_new_matched_tokens"],
    "layertap.engine.saves": ["SchedulerSide.build_meta", "SchedulerSide.finished", "SchedulerSide._job"],
    "layertap.engine.cache_view": ["check_planes", "scatter_planes"],
    "layertap.engine.compat": ["KernelScatter.__call__"],
    "layertap.engine.record_writer": ["WorkerSide.finished", "WorkerSide._gather_group_lean", "WorkerSide._reserve_raw",
                                      "WorkerSide._bound_staging", "WorkerSide._blocks",
                                      "WorkerSide._gather_group_offload"],
    "layertap.engine.record_proc": ["RecordProcess.alloc", "RecordProcess.send", "RecordProcess.record_event",
                                    "_Writer.group"],
    "layertap.engine.gpu_gather": ["IndexUpload.__call__"],
    "layertap.transport.shm": ["ShmSink.reserve", "ShmSink.wake_consumer", "ShmSource.poll"],
    "layertap.tap": ["Tap._prove", "Tap.step", "Tap._expected"],
    "vllm.v1.engine.llm_engine": ["LLMEngine.step", "LLMEngine.add_request"],
    "vllm.v1.engine.output_processor": ["OutputProcessor.process_outputs"],
    "vllm.v1.engine.core_client": ["SyncMPClient.get_output", "SyncMPClient.add_request"],
}

if _DIR:
    import importlib.abc
    import importlib.util
    import json
    import signal
    import sys
    import time

    SIGNAL = signal.SIGRTMIN + 3
    _stats: dict[str, list] = {}
    _dumps = [0]
    _clock = time.perf_counter

    def _wrap(name: str, fn):
        st = _stats.setdefault(name, [0, 0.0])

        def timed(*a, **k):
            t = _clock()
            try:
                return fn(*a, **k)
            finally:
                st[0] += 1
                st[1] += _clock() - t

        timed.__wrapped__ = fn
        timed.__name__ = getattr(fn, "__name__", "timed")
        return timed

    def _patch(mod) -> None:
        for q in TARGETS.get(mod.__name__, []):
            owner, _, attr = q.rpartition(".")
            obj = getattr(mod, owner, None) if owner else mod
            fn = getattr(obj, attr, None) if obj is not None else None
            if fn is None or getattr(fn, "__wrapped__", None) is not None:
                continue
            setattr(obj, attr, _wrap(f"{mod.__name__.rsplit('.', 1)[-1]}:{q}", fn))

    class _Loader(importlib.abc.Loader):
        def __init__(self, inner):
            self.inner = inner

        def create_module(self, spec):
            return self.inner.create_module(spec)

        def exec_module(self, module):
            self.inner.exec_module(module)
            _patch(module)

        def __getattr__(self, name):  # the rest of the loader's interface (``python -m`` needs get_code)
            return getattr(self.inner, name)

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name not in TARGETS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader)
            return spec

    for _name in list(TARGETS):
        if _name in sys.modules:
            _patch(sys.modules[_name])
    sys.meta_path.insert(0, _Finder())

    def _dump(*_a) -> None:
        if not _stats:
            return
        os.makedirs(_DIR, exist_ok=True)
        try:
            title = open(f"/proc/{os.getpid()}/cmdline", "rb").read().split(b"\0")[0].decode(errors="replace")
        except OSError:
            title = "?"
        path = os.path.join(_DIR, f"{os.getpid()}.{_dumps[0]}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "title": title, "n": _dumps[0],
                       "stats": {k: list(v) for k, v in _stats.items()}}, f)
        os.replace(path + ".tmp", path)
        _dumps[0] += 1

    signal.signal(SIGNAL, _dump)
