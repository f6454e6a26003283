"""``layertap capture``, ``verify``, ``demo`` and ``build-model``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layertap.transport.base import available, get_transport


def _layers(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants comma-separated integers, got {s!r}") from None


def register(sub) -> None:
    p = sub.add_parser("capture", help="capture hidden states of a JSONL of inputs through vLLM",
                       description="Capture per-request hidden states. Any flag not listed here is passed to "
                                   "vLLM's engine under vLLM's own name (--max-model-len, --max-num-seqs, "
                                   "--max-num-batched-tokens, --enable-prefix-caching, --dtype, ...).")
    p.add_argument("--model", required=True, help="local model directory (save_pretrained format)")
    p.add_argument("--data", required=True, help="JSONL: {prompt}, {messages}, {conversations} or {token_ids} per line")
    p.add_argument("--layers", required=True, type=_layers,
                   help="layer ids, e.g. 1,2,4 (0 = embeddings, N = last layer before the final norm)")
    p.add_argument("--out", required=True, help="dataset directory (file transport); an existing one is resumed")
    p.add_argument("--mode", choices=["prompt", "generate"], default="prompt",
                   help="prompt: teacher forcing over the input; generate: input + generated tokens")
    p.add_argument("--max-tokens", type=int, default=32, help="generate mode: tokens to generate (greedy)")
    p.add_argument("--transport", choices=available(), default="file",
                   help="where records go (file writes --out; shm/mooncake stream, and --out receives them)")
    p.add_argument("--max-inflight", type=int, default=None, help="bound on requests in flight (default: engine's)")
    p.add_argument("--capture-path", choices=["hook", "extract"], default="hook",
                   help="hook (default): the model runner writes the rows, no speculative decoding; extract: "
                        "vLLM's extract_hidden_states method (an extra drafter step)")
    p.add_argument("--store-dtype", choices=["fp32", "fp16", "bf16", "fp8"], default=None,
                   help="store hidden states in this dtype (fp8 = e4m3 with a per-record scale); default: engine dtype")
    p.add_argument("--only-loss-masked", action="store_true",
                   help="keep only rows of assistant tokens (plus the row before each span, which predicts its "
                        "first token); records then carry their positions")
    for name in available():
        try:
            get_transport(name).add_cli_args(p)
        except ImportError:
            pass
    p.set_defaults(func=cmd_capture, accepts_engine_flags=True)

    v = sub.add_parser("verify", help="recompute a dataset with HF transformers and compare, exit 1 on mismatch")
    v.add_argument("path", help="dataset directory written by capture")
    v.add_argument("--model", default=None, help="model directory (default: the one recorded in the dataset)")
    v.add_argument("--threshold", type=float, default=0.999, help="min cosine per token and layer (fp32: 0.999)")
    v.add_argument("--limit", type=int, default=None, help="verify only the first N records")
    v.add_argument("--noise", default="auto", choices=("auto", "off", "bfloat16", "float16"),
                   help="noise floor for half-precision records: HF also runs in this dtype and each layer may "
                        "drift from the fp32 reference up to --noise-factor x HF's own drift (auto: the records' "
                        "dtype when bf16/fp16; deep bf16 models drift below 0.999 by rounding alone)")
    v.add_argument("--noise-factor", type=float, default=2.0,
                   help="how many times HF's own half-precision drift a record may show (default 2)")
    v.set_defaults(func=cmd_verify)

    d = sub.add_parser("demo", help="build a tiny model, capture the bundled conversations, verify, print a table")
    d.add_argument("--out", default="runs/demo", help="where the demo dataset goes (default runs/demo)")
    d.add_argument("--kind", default="qwen3", choices=["qwen3", "llama", "mistral-swa"], help="tiny model kind")
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("build-model", help="build (or reuse) a tiny local model and print its path")
    b.add_argument("--kind", default="qwen3", choices=["qwen3", "llama", "mistral-swa"])
    b.set_defaults(func=lambda a: print(__import__("layertap.models.tiny", fromlist=["x"]).tiny_model(a.kind)))


def cmd_capture(args) -> int:
    from rich.console import Console
    from tqdm import tqdm

    from layertap.data import load_inputs
    from layertap.engine.launch import engine_kwargs
    from layertap.tap import Tap
    from layertap.targetinfo import TargetInfo
    from layertap.transport.file import FileDataset, FileSink

    console = Console(stderr=True)
    kw = engine_kwargs(args.engine_argv)
    target = TargetInfo.load(args.model)
    target.check_layer_ids(args.layers)
    items = load_inputs(args.data, target.tokenizer)  # bad input fails here, before the engine starts
    out = Path(args.out)
    done = FileDataset(out).committed_indices() if (out / "dataset.json").exists() else set()
    if done:
        console.print(f"resuming {out}: {len(done)} of {len(items)} inputs already captured")
    tcfg = get_transport(args.transport).config_from_args(args)
    if args.store_dtype or args.only_loss_masked:
        tcfg["compact"] = {"dtype": args.store_dtype or "fp32", "only_loss_masked": args.only_loss_masked}
    sp = None
    if args.mode == "generate":
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    with Tap(model=args.model, layers=args.layers, transport=args.transport, transport_config=tcfg,
             out=out if args.transport == "file" else None, max_inflight=args.max_inflight,
             capture_path=args.capture_path, **kw) as tap:
        sink = None
        if args.transport != "file":  # streamed: the consumer (this process) writes the dataset
            tap._write_dataset_manifest(out)
            sink = FileSink(out, "consumer")
        n = 0
        with tqdm(total=len(items) - len(done), desc="capture", unit="req") as bar:
            for rec in tap.capture(items, mode=args.mode, sampling_params=sp, skip_indices=done):
                if sink is not None:
                    from layertap.records import record_tensors

                    sink.put(rec.key, record_tensors(rec), rec.meta)
                    rec.release()
                n += 1
                bar.update(1)
        if sink is not None:
            sink.close()
        if tap.rejected:
            (out / "rejected.jsonl").write_text("".join(json.dumps(r.__dict__) + "\n" for r in tap.rejected))
            for r in tap.rejected:
                console.print(f"[yellow]rejected[/yellow] {r.reason}")
    console.print(f"captured {n} records into {out} ({len(tap.rejected)} rejected)")
    return 1 if tap.rejected else 0


def cmd_verify(args) -> int:
    from layertap.transport.file import load_records
    from layertap.verify import print_report, verify_records

    ds = load_records(args.path)
    model = args.model or ds.manifest.get("model")
    if not model:
        print(f"layertap verify: {args.path} names no model; pass --model", file=sys.stderr)
        return 2
    report = verify_records(ds, model, threshold=args.threshold, limit=args.limit, noise=args.noise,
                            noise_factor=args.noise_factor)
    print_report(report)
    return 0 if report.ok else 1


def cmd_demo(args) -> int:
    import shutil

    from rich.console import Console

    from layertap.models.tiny import tiny_model
    from layertap.tap import Tap
    from layertap.transport.file import load_records
    from layertap.verify import print_report, verify_records

    console = Console()
    sample = Path(__file__).resolve().parents[1] / "data_files" / "sample_convs.jsonl"
    console.rule("layertap demo")
    model = tiny_model(args.kind)
    console.print(f"tiny {args.kind} model: {model}")
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    layers = [0, 1, 2, 4]
    console.print(f"capturing {sample.name} (prompt mode, layers {layers}) under concurrency, prefix caching on")
    with Tap(model=model, layers=layers, out=out, dtype="float32", max_model_len=1024, max_num_seqs=64,
             max_num_batched_tokens=512, enable_prefix_caching=True, kv_cache_memory_bytes=256 << 20) as tap:
        n = sum(1 for _ in tap.capture(sample))
    console.print(f"{n} records committed to {out}; verifying against HF transformers (fp32)")
    report = verify_records(load_records(out), model)
    print_report(report, console)
    return 0 if report.ok else 1
