"""``layertap serve``: vLLM's OpenAI-compatible server with capture on, for real traffic.

Nothing is captured by default. A request opts in with ``"kv_transfer_params": {"layertap": {}}`` in its
body (vLLM hands ``kv_transfer_params`` to the connector through the sampling params); ``--capture-all``
captures every request. Records hold the prompt and the generated tokens (mode ``generate``: every
token that ran through the model, i.e. all but the last sampled one), proven by their token digest like
any record, and go to the transport: ``file`` (a dataset in ``--out`` that ``load_records`` and
``train-offline`` read; the default), ``shm`` or ``mooncake`` (a consumer attaches to the printed config).

The server is ``python -m vllm.entrypoints.openai.api_server`` in a child process, bound to 127.0.0.1 unless
``--host`` says otherwise; any flag ``serve`` does not know goes to vLLM's server unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="vLLM's OpenAI server with opt-in hidden-state capture of real traffic",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target model directory (HF format)")
    p.add_argument("--layers", required=True, help="vLLM aux layer ids to capture, e.g. 1,2,3,4")
    p.add_argument("--transport", choices=("file", "shm", "mooncake"), default="file", help="record transport")
    p.add_argument("--out", default="runs/served", help="file transport: dataset directory (default runs/served)")
    p.add_argument("--mooncake-master", default=None, help="mooncake transport: master host:port")
    p.add_argument("--capture-all", action="store_true",
                   help="capture every request (default: only requests whose body carries "
                   "kv_transfer_params.layertap)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    from layertap.transport.base import get_transport

    get_transport("shm").add_cli_args(p)  # --shm-slot-mb, --shm-slots, ...: the pool a consumer attaches to
    p.add_argument("--capture-path", choices=("hook", "extract"), default="hook",
                   help="hook (default): the model runner writes the rows, no speculative decoding; extract: "
                        "vLLM's extract_hidden_states method")
    p.add_argument("--connector-options", type=_connector_options_arg, default={}, metavar="JSON",
                   help='advanced: connector switches as a JSON object, e.g. \'{"lean": false}\' (the torch record '
                        'path) or \'{"skip_reads": true}\' (no record read or written: a benchmark\'s floor)')
    p.set_defaults(func=run_serve, accepts_engine_flags=True)


def _layers(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers expects comma-separated integers, got {s!r}") from None


def transport_config(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    from layertap.transport.base import get_transport

    cfg: dict[str, Any] = {}
    if args.transport == "shm" and hasattr(args, "shm_slots"):
        cfg = get_transport("shm").config_from_args(args)
    if args.transport == "file":
        cfg["path"] = str(Path(args.out))
    elif args.transport == "mooncake":
        if not args.mooncake_master:
            raise ValueError("--transport mooncake needs --mooncake-master host:port")
        cfg["master"] = args.mooncake_master
    return args.transport, {**get_transport(args.transport).prepare(cfg), "backend": args.transport}


def run_meta(model: str, layers: list[int]) -> tuple[dict[str, Any], list[int]]:
    from layertap.engine import compat
    from layertap.records import LAYER_SEMANTICS
    from layertap.targetinfo import TargetInfo

    t = TargetInfo.load(model)
    ids = t.check_layer_ids(layers)
    compat.check_model_tappable(t.config.get("architectures"), t.config.get("model_type"))
    return {"model": str(t.path), "config_hash": t.config_hash, "vllm_version": compat.check_version(),
            "layer_semantics": LAYER_SEMANTICS, "num_hidden_layers": t.num_layers, "hidden_size": t.hidden_size,
            "format_version": 1, "source": "serve"}, ids


def _connector_options_arg(text: str) -> dict[str, Any]:
    """argparse's reading of ``--connector-options``: parsed and checked once, refused with the problem named."""
    from layertap.engine import launch

    try:
        return connector_options(text)
    except launch.ConnectorOptionError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def connector_options(text: str | None) -> dict[str, Any]:
    """``--connector-options``: a JSON object of known connector switches, or ``ConnectorOptionError`` naming the
    problem."""
    from layertap.engine import launch

    if not text:
        return {}
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as e:
        raise launch.ConnectorOptionError(f"--connector-options is not JSON ({e.msg}): {text!r}") from None
    return launch.check_connector_options(opts, launch.CONNECTOR_OPTIONS + launch.SERVE_ONLY_OPTIONS)


def server_argv(args: argparse.Namespace, tcfg: dict[str, Any], meta: dict[str, Any], ids: list[int]) -> list[str]:
    from layertap.engine import launch
    from layertap.tap import owner_info

    path = getattr(args, "capture_path", None) or "hook"
    opts = getattr(args, "connector_options", None) or {}  # checked when the command line was parsed
    extra = {"transport": tcfg, "run_meta": meta, "capture_all": bool(args.capture_all), "owner": owner_info(),
             "default_mode": "generate", "capture_path": path, "layer_ids": list(ids), **opts}
    capture = launch.engine_capture_kwargs(path, ids, {})
    flags = [*(["--speculative-config", json.dumps(capture["speculative_config"])] if "speculative_config" in capture
               else []), *(["--worker-cls", capture["worker_cls"]] if "worker_cls" in capture else [])]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", meta["model"],
            "--host", args.host, "--port", str(args.port), *flags,
            "--kv-transfer-config", json.dumps(launch.kv_transfer_config(extra)),
            *list(getattr(args, "engine_argv", []) or [])]


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until it exits or Ctrl-C; the transport is freed and the server tree stopped after."""
    from layertap.pipeline.evaluate import stop_tree
    from layertap.transport.base import get_transport

    meta, ids = run_meta(args.model, _layers(args.layers))
    name, tcfg = transport_config(args)
    if name == "file":
        man = Path(tcfg["path"]) / "dataset.json"
        if not man.exists():
            man.write_text(json.dumps({**meta, "layer_ids": ids}, indent=1))
    argv = server_argv(args, tcfg, meta, ids)
    print(f"layertap serve: http://{args.host}:{args.port}/v1  capture "
          f"{'of every request' if args.capture_all else 'opt-in per request'} -> {name} "
          f"{tcfg.get('path') or tcfg.get('name') or tcfg.get('master')}", flush=True)
    if name != "file":
        print("transport config for a consumer: " + json.dumps(tcfg), flush=True)
    import torch

    from layertap.engine import launch

    engine = launch.engine_kwargs(list(getattr(args, "engine_argv", None) or []))  # vLLM's own parser: -tp, -pp, ...
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", **launch.engine_env(torch.cuda.is_available(), engine)}
    proc = subprocess.Popen(argv, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        return 130
    finally:
        if proc.poll() is None:
            stop_tree(proc.pid, 30)
        if name != "file":
            get_transport(name).cleanup(tcfg)
