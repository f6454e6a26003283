"""The ``layertap`` command: subcommands only; each module parses its flags and calls the library."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules; each defines ``register(subparsers)``. Optional ones (missing extras) are skipped
# with a note in --help rather than breaking the whole command.
_MODULES = ["layertap.cli.capture_cmds", "layertap.cli.train_cmds", "layertap.cli.analysis_cmds",
            "layertap.cli.pipeline_cmds"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="layertap",
        description="Per-request hidden states from a live vLLM engine, proven against HF transformers.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (vLLM's own logs too)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("layertap.cli"):
                continue  # subcommand group not built yet
            raise
        mod.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if rest and not getattr(args, "accepts_engine_flags", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.engine_argv = rest
    try:
        return int(args.func(args) or 0)
    except _user_errors() as e:  # a named problem with the user's input or set-up: no traceback
        print(f"layertap {args.command}: error: {e}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    from layertap.data import InputError
    from layertap.engine.compat import KnownVLLMBug, UnsupportedVLLM
    from layertap.engine.launch import EngineFlagError
    from layertap.errors import CaptureError
    from layertap.records import RecordError
    from layertap.targetinfo import TargetError
    from layertap.transport.base import TransportError

    return (InputError, TargetError, TransportError, RecordError, FileNotFoundError, KnownVLLMBug, UnsupportedVLLM,
            CaptureError, EngineFlagError)


if __name__ == "__main__":
    sys.exit(main())
