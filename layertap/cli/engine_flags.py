"""vLLM engine flags, by vLLM's own names: whatever layertap does not know goes to vLLM's parser."""

from __future__ import annotations

from typing import Any


def engine_kwargs(argv: list[str]) -> dict[str, Any]:
    """Parse ``argv`` with vLLM's ``EngineArgs`` parser; return only the flags the user set."""
    if not argv:
        return {}
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="layertap (vLLM engine flags)"))
    defaults = vars(parser.parse_args([]))
    ns = vars(parser.parse_args(argv))
    out = {k: v for k, v in ns.items() if v != defaults.get(k)}
    for owned in ("model", "speculative_config", "kv_transfer_config", "worker_cls"):
        if owned in out:
            raise SystemExit(f"layertap: --{owned.replace('_', '-')} is set by layertap itself; remove it")
    return out
