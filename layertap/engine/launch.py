"""What a capture engine is started with, through vLLM's public seams only: the ``LLM(...)`` arguments
that switch capture on (``worker_cls``, ``speculative_config``, ``kv_transfer_config``), the process
environment its processes inherit, and vLLM engine flags read from a command line.

The Tap, ``layertap serve`` and the benchmarks start their engines with these. Nothing here depends on
the vLLM version; what does (engine defaults per version, known bugs) is in ``compat``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

log = logging.getLogger("layertap")

CONNECTOR_NAME = "LayertapConnector"
CONNECTOR_MODULE = "layertap.engine.connector"
CAPTURE_PATHS = ("hook", "extract")
HOOK_WORKER = "layertap.engine.hook_worker.LayertapWorker"
OWNED_FLAGS = ("model", "speculative_config", "kv_transfer_config", "worker_cls")
"""Engine arguments layertap sets itself; a command line may not give them."""


CONNECTOR_OPTIONS = ("direct", "writer_queue", "device_commit", "full_graphs", "hook_scatter", "quiet_layers",
                     "quiet_empty_steps", "gather_only", "lean", "block_hashes", "offload", "offload_staging_mb",
                     "offload_copy_chunk_kb", "offload_rows")
"""Connector switches a caller may set (the Tap's ``connector_options``, ``layertap serve --connector-options``):
record-path variants and benchmark aids, each read by the connector from its extra config."""
SERVE_ONLY_OPTIONS = ("skip_reads",)
"""Also accepted by ``layertap serve``: ``skip_reads`` runs the capture engine and connector but reads and
writes no record (a benchmark's floor; a Tap would wait for records that never come)."""


class ConnectorOptionError(ValueError):
    """Connector options that are not a mapping of known switches; the message names the problem."""


def check_connector_options(opts: Any, allowed: tuple[str, ...] = CONNECTOR_OPTIONS) -> dict[str, Any]:
    """``opts`` as a dict, or ``ConnectorOptionError`` naming what is wrong: not a mapping, or a key that is not a known
    option (a typo would otherwise be ignored by the connector without a word)."""
    if opts is None:
        return {}
    if not isinstance(opts, dict):
        raise ConnectorOptionError(f"connector options must be a mapping of option to value, got {type(opts).__name__}")
    unknown = sorted(set(opts) - set(allowed))
    if unknown:
        raise ConnectorOptionError(f"unknown connector options {unknown}; known: {', '.join(sorted(allowed))}")
    return dict(opts)


class EngineFlagError(ValueError):
    """A vLLM engine flag on the command line that layertap sets itself; the message names it."""


def check_capture_path(path: str) -> None:
    if path not in CAPTURE_PATHS:
        raise ValueError(f"unknown capture path {path!r}; expected one of {CAPTURE_PATHS}")


def engine_capture_kwargs(path: str, layer_ids: list[int], user_kwargs: dict[str, Any]) -> dict[str, Any]:
    """The ``LLM(...)`` arguments that switch capture on, for either path.

    ``hook`` (default): layertap's worker class asks the target model for its residual-stream outputs
    (vLLM's EAGLE-3 aux-hidden-state mechanism, inside the compiled graph) and writes them from the
    model runner's forward into a cache-only KV layer of its own; no speculative decoding runs.
    ``extract``: vLLM's ``extract_hidden_states`` speculative method writes the same tensors into the
    same kind of layer through a dummy drafter (an extra forward and a draft slot per step).
    Both fill a ``HiddenStateCacheSpec`` group that the connector reads the same way.
    """
    check_capture_path(path)
    for k in ("speculative_config", "worker_cls"):
        if user_kwargs.get(k) not in (None, "auto"):
            raise ValueError(f"{k} is set by layertap's capture (path {path!r}); it cannot be given as well")
    if path == "extract":
        # On the CPU build layertap's worker class also runs on the extract path: it carries the seeded
        # sampling fix (compat.install_cpu_seed_rewind) that both paths need there.
        out: dict[str, Any] = {"speculative_config": speculative_config(layer_ids)}
        return out if torch.cuda.is_available() else {**out, "worker_cls": HOOK_WORKER}
    return {"worker_cls": HOOK_WORKER}


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


def engine_kwargs(argv: list[str]) -> dict[str, Any]:
    """vLLM engine flags by vLLM's own names (``--max-model-len``, ``-tp``, ...), parsed with vLLM's
    ``EngineArgs`` parser; returns only the flags set. ``EngineFlagError`` for a flag in ``OWNED_FLAGS``."""
    if not argv:
        return {}
    from layertap.engine.compat import engine_arg_parser

    parser = engine_arg_parser("layertap (vLLM engine flags)")
    defaults = vars(parser.parse_args([]))
    ns = vars(parser.parse_args(argv))
    out = {k: v for k, v in ns.items() if v != defaults.get(k)}
    for owned in OWNED_FLAGS:
        if owned in out:
            raise EngineFlagError(f"--{owned.replace('_', '-')} is set by layertap itself; remove it")
    return out


CPU_RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
MP_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def engine_env(on_cuda: bool, kw: dict[str, Any], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables a capture engine needs set before it starts.

    Spawned engine processes, on both platforms, unless the user chose (``VLLM_WORKER_MULTIPROC_METHOD``).
    vLLM forks its engine core when this process has not initialized CUDA. A fork inherits GNU OpenMP's
    state but not its worker threads, so once this process has run a multi-threaded torch CPU op (proving a
    record, building a model, an HF pass) the forked engine deadlocks in its first parallel CPU op: on the
    H200 every engine start after the first in one process hung after "Using V2 Model Runner" (py-spy:
    ``torch.zeros`` in libgomp, from the V2 runner's ``UvaBuffer``), and a start after any earlier CPU
    work in the process would too. With spawn the engine starts clean (its module imports once more).

    vLLM's CPU backend reserves one more core for the engine when any KV connector is configured (meant
    for NIXL's transfer thread), and on a small machine that leaves the worker bound to fewer cores than
    its OpenMP thread count: on the 2-core CI machine the worker got OMP_NUM_THREADS=2 on one core, and
    every multi-threaded CPU op then spin-waited against the step's own thread (on a hidden-64 model at 1
    request in flight, the hook engine without reads ran at 0.34 of plain; 0.80-0.89 with this).
    layertap's connector needs no core of its own (its writer thread sleeps on its queue), so capture
    engines reserve what vLLM reserves without a connector: one core per local worker. A value the user
    set wins."""
    environ = os.environ if environ is None else environ
    out: dict[str, str] = {}
    method = environ.get(MP_METHOD_ENV)
    if method is None:
        out[MP_METHOD_ENV] = "spawn"
    elif method == "fork":
        log.warning("layertap: %s=fork: a vLLM engine forked from a process that has run multi-threaded torch "
                    "CPU work (OpenMP) deadlocks in its first parallel CPU op (seen on the H200: start-up hung "
                    "after 'Using V2 Model Runner'); layertap's default is spawn", MP_METHOD_ENV)
    if not on_cuda and CPU_RESERVED_ENV not in environ:
        workers = int(kw.get("tensor_parallel_size") or 1) * int(kw.get("pipeline_parallel_size") or 1)
        out[CPU_RESERVED_ENV] = str(workers)
    return out


@contextlib.contextmanager
def engine_env_set(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` in this process while an engine starts (its processes inherit it), then restore."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
