"""The KV connector that turns captured hidden-state rows (the hook path, or vLLM's
``extract_hidden_states``) into layertap records.

Loaded by vLLM through ``kv_connector_module_path``; vLLM builds one instance per side.

Scheduler side (engine-core process):
    build_connector_meta(out)      -> per step: finished requests to save, and (first steps) slot checks
    request_finished_all_groups()  -> a request with layertap params finished: queue its save, keep its
                                      blocks (return True) until the worker reports the rows read; this
                                      also keeps the engine stepping until the save reached the worker
    get_num_new_matched_tokens / update_state_after_alloc: store-only, nothing to load
Worker side (each worker process; only TP rank 0 reads and writes):
    register_kv_caches()           -> find the capture layer's view, its geometry; log it; check it
    save_kv_layer()                -> on the first steps: the slots this step wrote must include the
                                      slots we compute for the scheduled tokens of each request
    get_finished()                 -> gather rows of finished requests by their own block ids, hand them
                                      to the writer thread; report the blocks free in the same call (on
                                      CPU the rows are copied by then; on CUDA they are in a private
                                      device buffer, indexed by cache block, and the forward stream
                                      waits for that gather; the host copies run on their own stream and
                                      the writer thread commits each record when its copy is done)
    wait_for_save()                -> after the step: slot checks its forward did not run (under a FULL
                                      CUDA-graph replay no Python hook runs) against the step's slot mapping
    start_load_kv / wait_for_layer_load: no-ops
    has_connector_metadata()       -> False on steps without slot checks, so vLLM's wrapper around every
                                      attention layer skips its two connector calls (``quiet_layers``)
    quiet_empty_step()             -> a step with no forward and nothing for layertap (no save, no check, nothing
                                      to report) skips vLLM's connector round (``quiet_empty_steps``)

Rows are read by *the request's own block ids*: for a prompt-mode request on the hook path in the step
whose forward completes its prompt (its rows are final then, and its blocks are not held), otherwise when
it finishes (as the scheduler hands them to ``request_finished``). So prefix-cache hits, chunked prefill
and preemption need no special case: the rows are in the blocks the request's tokens live in. Which rows:
the prompt's (prompt mode), or every token that ran through the model (generate mode).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from layertap.engine import compat
from layertap.engine.cache_view import find_hidden_group
from layertap.engine.record_writer import WorkerSide
from layertap.engine.saves import PARAMS_KEY, LayertapMetadata, SaveJob, SchedulerSide, SlotCheck, SlotCheckError

__all__ = ["PARAMS_KEY", "LayertapConnector", "LayertapMetadata", "SaveJob", "SlotCheck", "SlotCheckError",
           "watch_owner"]

log = logging.getLogger("vllm.layertap")  # under "vllm": shown by vLLM's own log set-up


_OWNER_WATCH: list[threading.Thread] = []  # one per process

QUIET_LAYERS_ENV = "LAYERTAP_QUIET_LAYERS"  # 0: vLLM's wrapper calls the connector around every layer, every step
QUIET_EMPTY_ENV = "LAYERTAP_QUIET_EMPTY_STEPS"  # 0: a step with no forward always runs the connector's round


def watch_owner(owner: dict[str, int] | None, role: str, period: float = 0.5) -> None:
    """Kill this engine process when the process that started the engine is gone.

    vLLM's engine core and workers outlive a parent killed with SIGKILL (seen on the CPU build: both kept
    running, holding the capture pool, and Python's resource tracker kept waiting on them). Each engine
    process that loads the connector watches the owner's pid + start time and exits when it disappears."""
    if not owner or _OWNER_WATCH:
        return
    from layertap.transport.shm_pool import alive

    pid, start = int(owner["pid"]), int(owner["start"])

    def run() -> None:
        while alive(pid, start):
            time.sleep(period)
        log.error("layertap %s: the process that started this engine (pid %d) is gone; exiting so the engine "
                  "does not outlive it", role, pid)
        from layertap.engine.watchdog import mapped_segments

        for seg in mapped_segments([os.getpid()]):  # vLLM's queues between the engine's processes: the
            try:  # others are dying too, and nobody would unlink them after a SIGKILL
                os.unlink(seg)
            except OSError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    t = threading.Thread(target=run, name="layertap-owner-watch", daemon=True)
    t.start()
    _OWNER_WATCH.append(t)


class LayertapConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if not hasattr(self, "_connector_metadata"):  # read directly by has_connector_metadata
            raise compat.UnsupportedVLLM("this vLLM's KVConnectorBase_V1 keeps no _connector_metadata")
        self._extra = compat.extra_config(vllm_config)
        self._layer_ids = compat.capture_layer_ids(vllm_config)
        if compat.pp_size(vllm_config) != 1:
            raise compat.UnsupportedVLLM("layertap capture does not support pipeline parallelism (pp > 1)")
        groups = compat.group_infos(kv_cache_config)
        self._group = find_hidden_group(groups) if groups else 0
        self._block_size = groups[self._group].block_size if groups else int(vllm_config.cache_config.block_size)
        self._check_steps = int(self._extra.get("slot_check_steps", 4))
        self._quiet_layers = bool(self._extra.get("quiet_layers", os.environ.get(QUIET_LAYERS_ENV, "1") == "1"))
        self._quiet_empty = bool(self._extra.get("quiet_empty_steps",
                                                 os.environ.get(QUIET_EMPTY_ENV, "1") == "1"))
        self._group_desc = {
            "index": self._group, "block_size": self._block_size, "num_groups": len(groups),
            "own_group": bool(groups) and groups[self._group].spec_type == "HiddenStateCacheSpec",
            "group_types": [g.spec_type for g in groups],
        }
        watch_owner(self._extra.get("owner"), "scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(self)
            # connector option block_hashes=True: let vLLM hash every request's blocks anyway
            self._hashes_armed = (not self._extra.get("block_hashes")
                                  and compat.skip_request_block_hashes(vllm_config))
            log.info("layertap scheduler: hidden-state group %d of %s, manager block size %d, layer ids %s",
                     self._group, [f"{g.spec_type}" for g in groups], self._block_size, self._layer_ids)
        else:
            self._worker = WorkerSide(self, vllm_config)

    # ---------------- scheduler side ----------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            raise RuntimeError("layertap connector is store-only; it never loads external tokens")

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        if self._hashes_armed:  # the first step: the engine core is built, the one-shot must be used
            self._hashes_armed = False
            compat.check_block_hashes_skipped()
        return self._sched.build_meta(scheduler_output)

    def request_finished(self, request, block_ids):
        return self._sched.finished(request, list(block_ids))

    def request_finished_all_groups(self, request, block_ids):
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self._sched.finished(request, list(block_ids[self._group]))

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 reports finished_sending

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register(kv_caches)
        if self._quiet_empty:
            patched = compat.install_quiet_empty_steps()
            log.info("layertap worker: steps with no forward and nothing for layertap skip the connector round "
                     "(%s)", ", ".join(patched) or "not available in this vLLM")

    def quiet_empty_step(self, meta: Any) -> bool:
        """Whether a step with no forward may skip the connector's round (``compat.install_quiet_empty_steps``):
        it carries no save and no slot check, this worker has nothing to report and nothing failed. Such a
        round would bind the metadata, call ``get_finished`` for an empty answer and clear it again."""
        return (self._quiet_empty and type(meta) is LayertapMetadata and not meta.saves and not meta.checks
                and self._worker.idle())

    def start_load_kv(self, forward_context, **kwargs) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        self._worker.check_slots(layer_name, attn_metadata, self._get_connector_metadata())

    def has_connector_metadata(self) -> bool:
        """What vLLM's per-attention-layer wrapper asks before it calls ``wait_for_layer_load`` and
        ``save_kv_layer`` around *every* attention layer, every step. layertap needs those calls only on a
        step that carries slot checks (the first steps), so it answers False on the others: the wrapper
        then runs the layer straight (connector option ``quiet_layers``, default on). layertap's own hooks
        read the metadata through ``_bound_meta``."""
        # vLLM asks this once per attention layer per step: the bound metadata is read straight from the base
        # class's attribute (checked at start-up), not through two more calls
        meta = self._connector_metadata
        if meta is None:
            return False
        return not self._quiet_layers or bool(getattr(meta, "checks", None))

    def _bound_meta(self) -> KVConnectorMetadata | None:
        return self._get_connector_metadata() if super().has_connector_metadata() else None

    def wait_for_save(self) -> None:
        # After the step's forward: checks it did not run (FULL CUDA-graph replay) run now, or fail by name.
        meta = self._bound_meta()
        if meta is not None:
            self._worker.check_unrun(meta)

    def get_finished(self, finished_req_ids: set[str]):
        return self._worker.finished(self._bound_meta()), None

    def shutdown(self) -> None:
        if getattr(self, "_worker", None) is not None:
            self._worker.close()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        return None

