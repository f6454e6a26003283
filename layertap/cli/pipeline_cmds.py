"""CLI subcommands of the pipeline: ``train`` (live vLLM -> online drafter training -> report) and
``serve`` (vLLM's OpenAI server with opt-in capture). ``register(subparsers)`` adds them."""

from __future__ import annotations

import argparse
import sys
from typing import Any

_TRAIN_DESC = """\
Start a vLLM engine with capture, feed the conversations (optionally regenerating answers on-policy),
stream records over the transport to the trainer, train the drafter online, evaluate acceptance in vLLM
(against an ngram drafter), checkpoint, export, and write OUT/report.md (+ report.json, report.png).
With no flags at all it runs the embedded default: the tiny trained target, the bundled sample
conversations, EAGLE-3, shm, CPU vLLM. Unknown flags go to vLLM's engine parser (e.g. --max-num-seqs 8).

Precedence: defaults < --config YAML < the flags below < --set KEY=VALUE. Config keys:
"""


def register(subparsers: Any) -> None:
    from layertap.pipeline.config import config_help

    p = subparsers.add_parser("train", help="train a drafter online from a live vLLM engine (the main job)",
                              description=_TRAIN_DESC + config_help(),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target model directory (config key: target)")
    p.add_argument("--data", default=None, help="conversations JSONL (config key: data)")
    p.add_argument("--drafter", choices=("eagle3", "dflash"), default=None, help="drafter kind (config key: drafter)")
    p.add_argument("--out", default=None, help="run directory (config key: out)")
    p.add_argument("--config", default=None, help="YAML file with any of the config keys (unknown keys are errors)")
    p.add_argument("--transport", choices=("shm", "mooncake", "file"), default=None,
                   help="record transport (config key: capture.transport)")
    p.add_argument("--regenerate", action="store_true", default=None,
                   help="capture the target's own greedy answers (config key: capture.regenerate)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (config key: train.max_steps)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set train.lr=1e-3 --set capture.limit=40 (repeatable)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint (its saved config; inputs already "
                   "trained on are not captured again)")
    p.add_argument("--ray-engines", type=int, default=None, metavar="N",
                   help="scale out with Ray: N engine actors feed one trainer actor over Mooncake (needs ray, "
                   "--transport mooncake and --set capture.mooncake_master=HOST:PORT; joins RAY_ADDRESS if set, "
                   "else starts a local cluster; training only, no evaluation)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.set_defaults(func=_named_errors(_train), accepts_engine_flags=True)

    from layertap.pipeline.serve import add_serve_parser

    add_serve_parser(subparsers)


def _named_errors(func: Any) -> Any:
    """Config errors (ValueError naming the key) print as one line, like the CLI's other user errors."""

    def wrapped(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (ValueError, FileExistsError) as e:
            print(f"layertap {args.command}: error: {e}", file=sys.stderr)
            return 2

    return wrapped


def _train_ray(cfg: Any, n: int, resume: bool) -> int:
    from pathlib import Path

    try:
        import ray
    except ImportError as e:
        raise ValueError("--ray-engines needs `pip install ray`") from e
    from layertap.pipeline.ray_runner import run_ray

    ray.init(include_dashboard=False)
    try:
        rep = run_ray(cfg, num_engines=n, resume=resume)["report"]
    finally:
        ray.shutdown()
    print(f"\nreport: {Path(cfg.out) / 'report.md'}  (wall {rep['wall_s']} s)")
    print((Path(cfg.out) / "report.md").read_text())
    return 0


def resolve_config(args: argparse.Namespace) -> Any:
    from layertap.engine.launch import engine_kwargs
    from layertap.pipeline.config import apply_overrides, from_dict, load_yaml

    d: dict[str, Any] = load_yaml(args.config) if args.config else {}
    flags = {"target": args.target, "data": args.data, "drafter": args.drafter, "out": args.out}
    d.update({k: v for k, v in flags.items() if v is not None})
    for key, val in (("capture.transport", args.transport), ("capture.regenerate", args.regenerate),
                     ("train.max_steps", args.max_steps)):
        if val is not None:
            sec, name = key.split(".")
            d.setdefault(sec, {})[name] = val
    d = apply_overrides(d, list(args.sets))
    eng = engine_kwargs(list(getattr(args, "engine_argv", []) or []))
    if eng:
        d["engine"] = {**(d.get("engine") or {}), **eng}
    return from_dict(d)


def _train(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    if not args.verbose:  # vLLM's INFO lines drown the training log; -v brings them back
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from layertap.pipeline.run import load_run_config, run

    if args.resume:
        if not args.out:
            raise ValueError("--resume needs --out (the run directory to continue)")
        cfg = load_run_config(Path(args.out))
    else:
        cfg = resolve_config(args)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return 0
    if args.ray_engines:
        return _train_ray(cfg, args.ray_engines, args.resume)
    from layertap.pipeline.run import INTERRUPTED, install_interrupt_handlers

    # SIGTERM takes the same clean path as Ctrl-C (KeyboardInterrupt unwinds every `finally`).
    install_interrupt_handlers()
    try:
        rep = run(cfg, resume=args.resume)
    except BaseException as e:
        if not (isinstance(e, KeyboardInterrupt) or INTERRUPTED.is_set()):
            raise
        # Also when the interrupt surfaced as another error (e.g. the evaluation child, which got the same
        # Ctrl-C, failing): the user asked to stop.
        print("layertap train: interrupted; engine stopped, shared memory freed. Resume with "
              f"`layertap train --out {cfg.out} --resume`", file=sys.stderr)
        return 130
    print(f"\nreport: {Path(cfg.out) / 'report.md'}  (wall {rep['wall_s']} s)")
    print((Path(cfg.out) / "report.md").read_text())
    return 0
