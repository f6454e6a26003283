"""CLI subcommands for drafters: ``train-offline``, ``export``, ``eval`` (and ``prepare-hf``, a reference
dataset builder from an HF forward pass, for use before or next to vLLM capture).

``register(subparsers)`` adds them to the main ``layertap`` parser; each handler is ``func(args) -> int``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def register(subparsers: Any) -> None:
    _add_prepare(subparsers)
    _add_train(subparsers)
    _add_export(subparsers)
    _add_eval(subparsers)


# -- prepare-hf --------------------------------------------------------------------------------------
def _add_prepare(sub: Any) -> None:
    p = sub.add_parser("prepare-hf", help="build a training dataset with an HF forward pass (reference capture)",
                       description="Tokenize conversations (optionally regenerating the assistant turns with "
                       "the target in vLLM), run the target in transformers and store the chosen layers as a "
                       "`file` dataset that `train-offline` reads.")
    p.add_argument("--target", required=True, help="target model directory (HF format)")
    p.add_argument("--inputs", required=True, help="conversations JSONL (`messages` or ShareGPT `conversations`)")
    p.add_argument("--out", required=True, help="output dataset directory")
    p.add_argument("--layers", type=_ints, required=True,
                   help="vLLM layer ids to store, e.g. 1,2,3,4 (id i = input of decoder layer i; N = pre-norm last)")
    p.add_argument("--start", type=int, default=0, help="first input line to use (0-based)")
    p.add_argument("--limit", type=int, default=None, help="number of input lines to use (default: all)")
    p.add_argument("--regenerate", action="store_true",
                   help="replace assistant turns by the target's greedy answers (generated in vLLM)")
    p.add_argument("--max-tokens", type=int, default=128, help="answer length cap when regenerating")
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from layertap.data import load_inputs, read_jsonl
    from layertap.train.data import records_from_hf, regenerate, write_dataset

    lines = [obj for _, obj in read_jsonl(args.inputs)]
    lines = lines[args.start : None if args.limit is None else args.start + args.limit]
    if args.regenerate:
        items = regenerate(args.target, lines, max_tokens=args.max_tokens, kv_cache_memory_bytes=64 << 20,
                           max_model_len=1024, enforce_eager=True)
    else:
        items = load_inputs(lines, AutoTokenizer.from_pretrained(args.target))
    recs = records_from_hf(args.target, items, args.layers, extra_meta={"greedy_answer": bool(args.regenerate)})
    write_dataset(recs, args.out, {"model": str(args.target), "layer_ids": args.layers, "source": "hf-reference",
                                   "regenerated": bool(args.regenerate)})
    print(f"wrote {len(recs)} records ({sum(int(r.token_ids.shape[0]) for r in recs)} tokens) to {args.out}")
    return 0


# -- train-offline -----------------------------------------------------------------------------------
def _add_train(sub: Any) -> None:
    p = sub.add_parser("train-offline", help="train an EAGLE-3 or DFlash drafter from a `file` dataset",
                       description="Train a drafter from captured hidden states. The same trainer runs online "
                       "from a live stream (Python API: Trainer.fit(iterable of Records)).")
    p.add_argument("dataset", help="dataset directory written by capture (or prepare-hf)")
    p.add_argument("--kind", choices=("eagle3", "dflash"), required=True, help="drafter type")
    p.add_argument("--out", required=True, help="run directory: checkpoint.pt, tb/, training.png, history.json")
    p.add_argument("--target", default=None, help="target model directory (default: the dataset manifest's model)")
    p.add_argument("--aux-layers", type=_ints, default=None,
                   help="eagle3: vLLM aux ids fed to fc, e.g. 1,2,3 (default: captured ids below the last)")
    p.add_argument("--last-layer", type=int, default=None,
                   help="eagle3: id of the pre-norm last state (default: target num_hidden_layers)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="eagle3: draft vocabulary size (default: min(vocab, 32000, half the vocab for tiny vocabs))")
    p.add_argument("--ttt-steps", type=int, default=3, help="eagle3: training-time-test unroll length")
    p.add_argument("--target-layer-ids", type=_ints, default=None,
                   help="dflash: DFlash ids (output of layer k = aux id k+1); default: captured aux ids - 1")
    p.add_argument("--block-size", type=int, default=8, help="dflash: block size B (served with B-1 tokens)")
    p.add_argument("--dflash-layers", type=int, default=2, help="dflash: number of draft decoder layers")
    p.add_argument("--anchors", type=int, default=64, help="dflash: anchors sampled per sequence per step")
    p.add_argument("--epochs", type=int, default=1, help="passes over the dataset (reshuffled each epoch)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="optimizer steps, the LR schedule's length (default 200; on --resume the checkpoint's; "
                   "a different value on resume extends the run but is no longer bit-exact)")
    p.add_argument("--batch-size", type=int, default=4, help="records per step over all ranks (under torchrun each of N ranks takes batch_size / N)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, warmup + cosine)")
    p.add_argument("--warmup", type=int, default=20, help="warmup steps")
    p.add_argument("--max-len", type=int, default=512, help="truncate records to this many tokens")
    p.add_argument("--seed", type=int, default=0, help="seed for init, shuffling and anchor sampling")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--log-every", type=int, default=10, help="console log interval (steps)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (bit-exact)")
    p.add_argument("--no-tensorboard", action="store_true", help="skip TensorBoard event files")
    p.add_argument("--device", default="cpu", help="torch device (cuda trains under bf16 autocast)")
    p.set_defaults(func=_train)


def _target_of(args: argparse.Namespace, ds: Any) -> str:
    target = args.target or ds.manifest.get("model")
    if not target:
        raise SystemExit("train-offline: no --target given and the dataset manifest names no model")
    return str(target)


def _train(args: argparse.Namespace) -> int:
    from layertap.drafters.eagle3 import draft_vocab_from_counts
    from layertap.pipeline.drafter_config import drafter_config
    from layertap.train.config import TrainConfig
    from layertap.train.data import epoch_stream, token_counts
    from layertap.train.trainer import CKPT, Trainer
    from layertap.train.selftest import head_selftest
    from layertap.transport.file import load_records

    ds = load_records(args.dataset)
    if len(ds) == 0:
        raise SystemExit(f"train-offline: dataset {args.dataset} holds no records")
    # Under torchrun every rank runs this; only rank 0 speaks (the trainer itself writes on rank 0 only).
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    target = _target_of(args, ds)
    tcfg = TrainConfig(out_dir=args.out, lr=args.lr, warmup_steps=args.warmup, max_steps=args.max_steps or 200,
                       batch_size=args.batch_size, max_len=args.max_len, seed=args.seed,
                       log_every=args.log_every, save_every=args.save_every,
                       tensorboard=not args.no_tensorboard, device=args.device,
                       dtype="bfloat16" if args.device.startswith("cuda") else "float32",
                       extra={"epochs": args.epochs})
    ckpt = Path(args.out) / CKPT
    if args.resume:
        if not ckpt.exists():
            raise SystemExit(f"train-offline: --resume but no checkpoint at {ckpt}")
        tr = Trainer.load(ckpt, **({} if args.max_steps is None else {"max_steps": args.max_steps}))
        say(f"resumed at step {tr.step} ({tr.records_seen} records consumed)")
    else:
        try:
            cfg = drafter_config(args.kind, target, ds[0].layer_ids, draft_vocab=args.draft_vocab,
                                 aux_layers=args.aux_layers, last_layer=args.last_layer, ttt_steps=args.ttt_steps,
                                 target_layer_ids=args.target_layer_ids, dflash_layers=args.dflash_layers,
                                 block_size=args.block_size, anchors=args.anchors)
        except ValueError as e:
            raise SystemExit(f"train-offline: {e}") from None
        draft_ids = None
        if args.kind == "eagle3":
            say(head_selftest(target, ds, cfg.last_layer_id))
            draft_ids = draft_vocab_from_counts(token_counts(ds, cfg.shape.vocab_size), cfg.draft_vocab_size)
        tr = Trainer(args.kind, cfg, tcfg, target, draft_ids)
    # On resume the data order must be the original run's: take epochs and seed from the checkpoint.
    tr.fit(epoch_stream(ds, int(tr.tcfg.extra.get("epochs", args.epochs)), tr.tcfg.seed))
    path = tr.finish()
    say(f"saved {path} at step {tr.step}; plot {Path(args.out) / 'training.png'}")
    return 0


# -- export ------------------------------------------------------------------------------------------
def _add_export(sub: Any) -> None:
    p = sub.add_parser("export", help="write a trained drafter as a directory vLLM loads",
                       description="Formats: eagle3 -> legacy (LlamaForCausalLMEagle3) or speculators; "
                       "dflash -> zlab (DFlashDraftModel) or speculators.")
    p.add_argument("checkpoint", help="trainer checkpoint (RUN/checkpoint.pt)")
    p.add_argument("out", help="output directory")
    p.add_argument("--format", dest="fmt", default=None,
                   help="legacy | speculators (eagle3), zlab | speculators (dflash); default legacy / zlab")
    p.add_argument("--num-spec", type=int, default=3,
                   help="eagle3 speculators format: speculative tokens written in speculators_config")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weight dtype in the file (vLLM casts to its serving dtype)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    import torch

    from layertap.drafters.export import export

    out = export(args.checkpoint, args.out, args.fmt, num_spec=args.num_spec, dtype=getattr(torch, args.dtype))
    print(f"exported to {out}")
    return 0


# -- eval --------------------------------------------------------------------------------------------
def _add_eval(sub: Any) -> None:
    p = sub.add_parser("eval", help="acceptance of exported drafters in vLLM vs an ngram drafter",
                       description="Serve the target with each drafter (and ngram) in vLLM, decode held-out "
                       "prompts greedily, report mean acceptance length and per-position acceptance from "
                       "vLLM's counters, and check the outputs equal plain decoding. Exit 1 on a mismatch.")
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                   help="exported drafter directory (repeatable); kind read from its config.json")
    p.add_argument("--prompts", required=True,
                   help="JSONL of conversations; the prompt is everything before the last assistant turn")
    p.add_argument("--start", type=int, default=0, help="first line used (pick lines not trained on)")
    p.add_argument("--limit", type=int, default=32, help="number of prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--num-spec", type=int, default=3, help="eagle3 speculative tokens per step")
    p.add_argument("--dflash-num-spec", type=int, default=None, help="dflash speculative tokens (default B-1)")
    p.add_argument("--ngram-k", type=int, default=3, help="ngram drafter speculative tokens")
    p.add_argument("--kv-cache-bytes", type=int, default=64 << 20, help="vLLM kv_cache_memory_bytes")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    p.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from layertap.data import read_jsonl
    from layertap.drafters.export import speculative_config
    from layertap.train.data import prompt_of
    from layertap.train.eval import run_eval

    tok = AutoTokenizer.from_pretrained(args.target)
    lines = [obj for _, obj in read_jsonl(args.prompts)][args.start : args.start + args.limit]
    prompts = []
    for obj in lines:
        msgs = obj.get("messages") or [{"role": "user" if t["from"] in ("human", "user") else "assistant",
                                        "content": t["value"]} for t in obj["conversations"]]
        ids = tok.apply_chat_template(prompt_of(msgs), tokenize=True, add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    drafters = {}
    for spec in args.drafter:
        name, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"eval: --drafter expects NAME=DIR, got {spec!r}")
        kind = json.loads((Path(path) / "config.json").read_text())["layertap"]["kind"]
        drafters[name] = speculative_config(path, args.num_spec if kind == "eagle3" else args.dflash_num_spec)
    report = run_eval(args.target, drafters, prompts, max_tokens=args.max_tokens, ngram_k=args.ngram_k,
                      engine_kwargs={"kv_cache_memory_bytes": args.kv_cache_bytes})
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=1))
    bad = [r["name"] for r in report["results"] if not r["outputs_match_plain"]]
    if bad:
        print(f"outputs differ from plain decoding for: {', '.join(bad)}")
        return 1
    return 0
