"""The whole drafter loop on one machine, measured: train a target, train EAGLE-3 and DFlash online from
live vLLM (``layertap train``), do the same EAGLE-3 run offline (``capture`` + ``train-offline``), serve the
exported drafters in vLLM and time decoding against plain vLLM and ngram, and write one report.

    python benchmarks/gpu_loop.py --profile h200 --work /tmp/gpu_loop --out $OUT --deadline-s 575
    python benchmarks/gpu_loop.py --profile cpu-tiny --work /tmp/loop --out /tmp/loop-out   # CPU smoke run

On the GPU machine ``bash scripts/gpu_loop.sh`` sets up the environment and runs the first line; its header
lists the device calls. tests/engine/test_gpu_loop.py runs the second.

Stages, in order (``--stages``, default all); each is skipped when its result file exists in ``--work``,
so a run split over several device calls resumes where the last one stopped:
    target   train the target (``layertap.models.train_target``, sizes from the profile) on the stdlib
             corpus, on CUDA in bf16 where the profile says so; cached by spec hash (``LAYERTAP_CACHE``)
    eagle3   ``python -m layertap train --drafter eagle3`` (real CLI, subprocess): engine and trainer on one
             device, records over shm, periodic acceptance evaluations, export; an interrupted run resumes
    dflash   the same for DFlash; with ``parallel_drafters`` (both profiles) it runs at the same time as
             eagle3, each stage in a thread of this script driving its own ``layertap train`` process
    serve    one worker process per variant (plain, ngram, eagle3, dflash), all engines alive at once and
             timed in interleaved rounds (each round: every concurrency on every variant back to back), so a
             speed-up is the median of per-round ratios. vLLM ``LLM``, greedy, the held-out prompts at each
             concurrency b (b requests in flight, a new one entering as one finishes:
             ``evaluate.timed_decode``): output tokens/s after a warm-up, per-request time per output token
             (median, p99), mean acceptance length from vLLM's counters, the share of outputs equal to plain's
    offline  ``layertap capture`` (generate mode, file dataset) + ``layertap train-offline --kind eagle3``
             with the online run's inputs (the first ``offline_records`` of them), steps and batch: wall
             time of each and the dataset's bytes, per 1000 records beside the online run. It runs after
             serve (before it when ``eagle3-offline`` is served), so a lease lost late in the run has the
             speed-ups (the goal) already
    report   gpu_loop.json (raw, everything measured), gpu_loop.md and gpu_loop.png in --work/report and --out,
             with gpu_loop.log and gpu_loop_logs.tar.gz (every stage's log) beside them in --out

Time guard: ``--deadline-s N`` ends this invocation within N s of its start. A stage (a serve variant) whose
profile estimate does not fit in the time left is deferred, and later ones that fit still run; a subprocess
still running near the deadline gets SIGTERM (``layertap train`` stops cleanly and resumes next time). A
stage that failed is not retried by later calls unless ``--retry-failed``. Exit status: 75 while work
remains (call again: it resumes), else 1 when a stage failed (the others ran where they could), else 0.
Each stage's output goes to --work/logs/STAGE.log.

Memory on one GPU (profile h200): each capture engine has a fixed KV cache (``kv_cache_memory_bytes``: all
requests in flight with their capture planes, with room to spare) beside its weights and CUDA graphs; each
trainer (a ``layertap train`` process) allocates what it needs beside it; the evaluation engines that
the run starts while both are up use a fixed ``eval.kv_cache_mb`` and pass vLLM's start-up check with
``layertap.pipeline.evaluate.EVAL_GPU_MEMORY_UTILIZATION``. nvidia-smi is sampled during every stage, so
the report gives the measured peak of the device and of each process.

MFU counts model FLOPs (formulas in ``eagle3_flops_per_token`` / ``dflash_flops_per_token``) at the
trainer's busy throughput (its tokens over the time it was not waiting for a record) against the device's
bf16 dense peak; None on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from layertap.models.tiny import TinySpec  # noqa: E402  (light: no torch import at module level)
from layertap.models.train_target import TargetSpec  # noqa: E402

STAGES = ("target", "eagle3", "dflash", "serve", "offline", "report")
DRAFTERS = ("eagle3", "dflash")
SERVE_VARIANTS = ("plain", "ngram", "eagle3", "dflash")
OPTIONAL_VARIANTS = ("plain-v1", "eagle3-v1", "eagle3-offline")
"""``plain-v1`` / ``eagle3-v1``: on the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``): on CUDA, vLLM 0.25
runs ngram on V1 (the V2 runner has no ngram), everything else on V2. ``eagle3-offline``: the offline
drafter. Also ``eagle3-kN`` / ``dflash-kN``: the same drafter served with N speculative tokens."""
K_VARIANT = re.compile(r"(eagle3|dflash)-k([1-9][0-9]?)")


def known_variant(v: str) -> bool:
    return v in SERVE_VARIANTS or v in OPTIONAL_VARIANTS or K_VARIANT.fullmatch(v) is not None


def variant_drafter(v: str) -> str | None:
    """The training stage whose export a serving variant serves (None: no drafter of ours)."""
    if v == "eagle3-offline":
        return "offline"
    base = v.split("-", 1)[0]
    return base if base in DRAFTERS else None
EXIT_DEADLINE = 75
GRACE_S = 60.0
"""A subprocess still running this long before the deadline is stopped (SIGTERM, SIGKILL 40 s later)."""
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
"""Dense bf16 peaks by GPU name, for MFU (also benchmarks/train_throughput.py's)."""


# -- profiles ----------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Profile:
    """Every size of one run. Only the values differ between profiles; the code paths are the same."""

    name: str
    device: str
    """Trainer and target-training device: cuda | cpu."""
    target: TargetSpec
    target_dtype: str
    target_budget_s: float | None
    """Hard cap on the target's training loop (train_target's ``time_budget_s``)."""
    convs: int
    """Conversations written from the stdlib corpus (seed 1; the target trained on seed 0's)."""
    holdout: int
    """The last N conversations: evaluation and serving prompts, never trained on."""
    capture_max_tokens: int
    epochs: int
    max_inflight: int
    shm_slot_mb: int
    shm_slots: int
    steps: int
    drafter_steps: dict[str, int] = field(default_factory=dict)
    """Steps of one drafter where they differ from ``steps`` (e.g. ``drafter_steps={"eagle3": 2304}``: a
    longer EAGLE-3 run beside a DFlash run of ``steps``); the offline run takes EAGLE-3's."""
    batch: int
    max_len: int
    lr: dict[str, float]
    warmup: int
    save_every: int
    ttt_steps: int
    num_spec: int
    """EAGLE-3 speculative tokens, in the periodic evaluations and in serving."""
    block_size: int
    """DFlash block size B; served with B-1 speculative tokens."""
    dflash_layers: int
    anchors: int = 64
    """DFlash anchors per sequence (``layertap train``'s fixed value; for the FLOP count only)."""
    ngram_k: int = 3
    eval_every: dict[str, int]
    """Periodic evaluation interval per drafter (0: only the final evaluation)."""
    eval_prompts: int
    eval_max_tokens: int
    eval_kv_mb: int
    engine: dict[str, Any]
    """Capture engine kwargs (``layertap train`` ``--set engine.*``; ``layertap capture`` flags)."""
    serve_engine: dict[str, Any]
    serve_batches: tuple[int, ...]
    serve_prompts: dict[int, int]
    """Prompts decoded at each batch size (the first N held-out prompts)."""
    serve_max_tokens: int
    serve_repeats: int
    serve_variants: tuple[str, ...] = SERVE_VARIANTS
    """Variants served when ``--serve-variants`` is not given (plain, ngram, eagle3 and dflash always)."""
    serve_profile: tuple[str, ...] = ()
    """Variants whose engine is profiled (torch profiler, CPU + device) over a few batch-1 decodes after the
    timed rounds; the trace's summary (``benchmarks/trace_summary.py``) goes into the serve results."""
    margin_prompts: int = 0
    """Plain decodes the first N batch-1 prompts once more with top-2 logprobs, so each output that differs
    from plain's is placed where it first diverges: plain's top-1 - top-2 logprob margin there (a near tie
    flips under bf16 batch numerics; a speculation bug need not be near one)."""
    estimates: dict[str, float]
    """Seconds each stage (serve: each variant) takes on this profile's machine, for the deadline guard."""
    offline_records: int | None = None
    """The offline run (capture to disk, ``train-offline``) takes the first N of the online EAGLE-3 run's
    inputs (None: all of them) and as many steps as they fill; the report compares per 1000 records and
    extrapolates the dataset's size to the online run's. Its dataset holds every row on disk, which at the
    online run's size need not fit (3456 x 8 records of this target: ~96 GB)."""
    parallel_drafters: bool = False
    """Run the EAGLE-3 and DFlash stages at once (two ``layertap train`` runs, each with its capture engine
    and trainer, on the one device): their engine starts and evaluations overlap. Their capture engines
    then need a fixed KV cache (``engine.kv_cache_memory_bytes``): two engines profiling memory at the same
    moment would see each other's allocations."""
    memory_plan: str = ""


H200 = Profile(
    name="h200", device="cuda",
    # Qwen3-1.7B-like body (24 x 2048, GQA 16/8 heads of 128) with the 2048-token stdlib tokenizer:
    # 1.2 B parameters, 3.5 M training tokens (216 x 32 x 512; ~37 K tok/s measured in bf16 autocast),
    # the loop capped at 100 s so the stage fits the first device call while the vLLM bundle's second part is
    # still to come. 216 steps: what 100 s holds (222-226 steps in every H200 run since the fifth session), so
    # the cosine schedule ends at its floor instead of being cut half-way at 400 (loss 1.71-1.88 then).
    target=TargetSpec(model=TinySpec(kind="qwen3", hidden_size=2048, num_layers=24, num_heads=16, num_kv_heads=8,
                                     head_dim=128, intermediate_size=6144, vocab_size=2048),
                      steps=216, batch_size=32, seq_len=512, lr=6e-4, warmup=40),
    target_dtype="bfloat16", target_budget_s=100.0,
    # Fresh conversations, one pass, 8 records a step. DFlash: 768 steps. EAGLE-3: 3456 steps on 27,648
    # conversations (~6 M trained tokens). At 768 steps its AL in vLLM was 2.37 and its batch-1 speed-up 1.33x
    # (one iteration costs ~1.7x a plain step of CPU, so 1.5x needs AL >= ~2.55); at 2304 steps two runs
    # served AL 2.87 / 2.66 at batch 1 and 1.60x / 1.49x (RESULTS.md, 2026-12-02): at the goal's edge, so
    # 1.5x the data. The trainer set the pace at 2304 (idle 0.003, ~67 records/s); its batches are now built
    # on the device (benchmarks/train_data_path.py). Evaluations (engine starts) at the half-way step and the end.
    convs=27648 + 160, holdout=160, capture_max_tokens=128, epochs=1, max_inflight=128, shm_slot_mb=4, shm_slots=512,
    steps=768, drafter_steps={"eagle3": 3456}, batch=8, max_len=512, lr={"eagle3": 1e-3, "dflash": 6e-4}, warmup=30,
    save_every=192, ttt_steps=4, num_spec=4, block_size=8, dflash_layers=2,
    eval_every={"eagle3": 1728, "dflash": 384}, eval_prompts=16, eval_max_tokens=64, eval_kv_mb=2048,
    # Offline on the first 2048 inputs (256 steps, ~7.6 GB on disk; all 27,648 would need ~96 GB).
    offline_records=2048,
    # A fixed KV cache (16 GiB: ~150 K tokens of KV + capture planes, 128 requests of ~450 tokens need ~60 K):
    # the EAGLE-3 and DFlash capture engines start at the same moment (parallel_drafters) and must not size
    # their caches by profiling a device the other is filling. Utilization 0.2 only feeds the start-up check.
    engine={"gpu_memory_utilization": 0.2, "max_model_len": 1024, "max_num_seqs": 128,
            "kv_cache_memory_bytes": 16 << 30},
    parallel_drafters=True,
    # The four serving engines are alive at once (stage_serve), so each gets a fixed KV cache (6 GiB: ~60 K
    # tokens of target + drafter KV, 32 requests of <= 1024 need <= 33 K), which also skips vLLM's memory
    # profiling (engines starting together would see each other's allocations); utilization 0.1 only feeds
    # the start-up check. No prefix caching while timing: with it, every repeat after the first skipped its
    # prompts' prefill (the second H200 run's repeats of plain differed by up to 1.39x at b=8).
    serve_engine={"kv_cache_memory_bytes": 6 << 30, "gpu_memory_utilization": 0.1, "max_model_len": 1024,
                  "max_num_seqs": 32, "enable_prefix_caching": False},
    # b requests in flight (continuous batching); enough prompts that the drain at the end is a small part.
    # 3 interleaved rounds: batch-1 ratios of single rounds ranged 1.13-1.97 on 2026-12-02.
    serve_batches=(1, 8, 32), serve_prompts={1: 16, 8: 64, 32: 160}, serve_max_tokens=128, serve_repeats=3,
    # Beside the four: the same EAGLE-3 drafter with 3 speculative tokens (batch-1 decoding is bound by the
    # CPU's work per step: an iteration of 4 draft steps costs ~1.7x a plain step, so fewer can win; k=2 was
    # below k=4 at every batch size on 2026-12-02, eagle3-v1 0.63x on 2026-12-01: neither repeated). The
    # batch-1 profiles (serve_profile) of plain / EAGLE-3 / DFlash are in RESULTS.md (2026-12-01); not repeated.
    serve_variants=(*SERVE_VARIANTS, "eagle3-k3"), serve_profile=(),
    margin_prompts=16,
    # Seconds on an H200 (16 cores) for the deadline guard: target 160 s; a drafter stage is resumable, so
    # its estimate is what it needs to make progress (EAGLE-3 at 2304 steps took 716 s over two calls);
    # serve 356 s with five engines.
    estimates={"target": 200, "eagle3": 400, "dflash": 400, "offline": 200, "serve": 420, "report": 15},
    memory_plan=(
        "One H200 (~140 GiB) holds both online runs at once (parallel_drafters). Each capture engine has a "
        "fixed 16 GiB KV cache, where the capture planes live too (96 KiB KV + 16 KiB planes per token: ~150 K "
        "tokens; 128 requests of ~450 tokens in flight need ~60 K), beside its bf16 weights (2.3 GiB), CUDA "
        "graphs and activations (a few GiB): ~21 GiB each. Each trainer allocates what its drafter needs "
        "(EAGLE-3 ~10 GiB, DFlash ~37 GiB at 8 x 512-token batches). Each evaluation engine (eager; one per run "
        "at a time) takes its weights + a 2 GiB KV cache (eval.kv_cache_mb), passing vLLM's start-up check "
        "with gpu_memory_utilization 0.05. Peak ~100 GiB; none is capped by another. Serving runs all its "
        "engines at once, each with a 6 GiB KV cache."),
)

# The EAGLE-3 recipe that served >= 1.5x plain at batch 1 in every round (RESULTS.md, 2026-12-03, loop8: AL
# 3.36, 1.86x (1.64-2.36) over 6 rounds). 2x the data of H200's EAGLE-3 (6912 steps on 55,296 fresh
# conversations): the loss was still falling steeply at 3456 (2.55 / 1.95 in two runs) and the served AL
# followed it (2.57 at 3456 -> 3.36 here). The trainer sets the pace (idle 0.003 at 98 records/s), so the
# capture engine may run 256 requests (24 GiB KV: 256 of <= ~480 tokens need ~125 K tokens) and the shm pool
# holds 1024 x 4 MiB (a record of ~450 tokens x 4 layers spans two slots). Served: plain, ngram, eagle3 over
# 6 interleaved rounds, 32 batch-1 prompts (a round ~4 s at 16 was too short to average the host's drift).
# Run it alone: `--stages target,eagle3,serve,report` took 1,570 s of one H200 (EAGLE-3 971 s, serving 461 s);
# with DFlash and offline it needs more than one 30-minute lease.
H200_EAGLE3 = dataclasses.replace(
    H200, name="h200-eagle3",
    convs=55296 + 160, drafter_steps={"eagle3": 6912}, eval_every={"eagle3": 3456, "dflash": 384},
    max_inflight=256, shm_slots=1024, save_every=576,
    engine={"gpu_memory_utilization": 0.2, "max_model_len": 1024, "max_num_seqs": 256,
            "kv_cache_memory_bytes": 24 << 30},
    serve_variants=("plain", "ngram", "eagle3"), serve_prompts={1: 32, 8: 64, 32: 160}, serve_repeats=6,
    estimates={**H200.estimates, "eagle3": 1000, "serve": 480},
    memory_plan=(
        "The EAGLE-3 capture engine has a fixed 24 GiB KV cache, where the capture planes live too (96 KiB KV + "
        "16 KiB planes per token: ~225 K tokens; 256 requests of ~450 tokens in flight need ~125 K), beside its "
        "bf16 weights (2.3 GiB), CUDA graphs and activations: ~30 GiB. The trainer allocates what EAGLE-3 needs "
        "(~7-10 GiB at 8 x 512-token batches); each evaluation engine (eager, one at a time) its weights + a "
        "2 GiB KV cache. Peak ~44 GiB of 140. Serving runs its three engines at once, each with a 6 GiB KV "
        "cache. With DFlash beside it (all stages), add H200's DFlash run (~21 + 37 GiB)."),
)

CPU_TINY = Profile(
    name="cpu-tiny", device="cpu",
    target=TargetSpec(),  # the CPU main job's target: cached under LAYERTAP_CACHE, trained once
    target_dtype="float32", target_budget_s=None,
    convs=32 + 8, holdout=8, capture_max_tokens=24, epochs=1, max_inflight=16, shm_slot_mb=4, shm_slots=32,
    steps=6, batch=4, max_len=256, lr={"eagle3": 2e-3, "dflash": 2e-3}, warmup=2, save_every=3,
    ttt_steps=3, num_spec=3, block_size=4, dflash_layers=2,
    # One periodic evaluation (EAGLE-3's) is enough to prove the path here: each costs a CPU engine start.
    eval_every={"eagle3": 3, "dflash": 0}, eval_prompts=4, eval_max_tokens=16, eval_kv_mb=64,
    engine={},  # layertap train's CPU defaults (eager, 128 MiB KV cache, 1024 context)
    parallel_drafters=True,  # the H200 profile's path; on 2 cores the two stages take about as long as in turn
    offline_records=16,  # half the training conversations: the subset path of the H200 profile
    serve_engine={"enforce_eager": True, "kv_cache_memory_bytes": 64 << 20, "max_model_len": 1024,
                  "max_num_seqs": 4, "enable_prefix_caching": False},
    serve_batches=(1, 4), serve_prompts={1: 2, 4: 4}, serve_max_tokens=16, serve_repeats=2,
    serve_profile=("eagle3",), margin_prompts=2,
    estimates={"target": 400, "eagle3": 200, "dflash": 160, "offline": 120, "serve": 200, "report": 15},
    memory_plan="CPU: every engine sizes its KV cache with kv_cache_memory_bytes; no device memory to split.",
)

PROFILES = {p.name: p for p in (H200, H200_EAGLE3, CPU_TINY)}


def apply_overrides(p: Profile, items: list[str]) -> Profile:
    """``KEY=VALUE`` (VALUE as JSON, else a string): a Profile field, ``target.FIELD`` or ``target.model.FIELD``."""
    for item in items:
        key, eq, raw = item.partition("=")
        if not eq:
            raise SystemExit(f"--override expects KEY=VALUE, got {item!r}")
        try:
            val = json.loads(raw)
        except json.JSONDecodeError:
            val = raw
        parts = key.split(".")
        if parts[0] == "target" and len(parts) > 1:
            t = p.target
            if parts[1] == "model":
                t = dataclasses.replace(t, model=dataclasses.replace(t.model, **{parts[2]: val}))
            else:
                t = dataclasses.replace(t, **{parts[1]: val})
            p = dataclasses.replace(p, target=t)
        elif parts[0] in {f.name for f in dataclasses.fields(Profile)} and len(parts) == 1:
            if parts[0] == "serve_prompts":
                val = {int(k): int(v) for k, v in val.items()}
            if parts[0] in ("serve_batches", "serve_variants", "serve_profile"):
                val = tuple(val)
            if parts[0] == "drafter_steps" and (not isinstance(val, dict) or set(val) - set(DRAFTERS)):
                raise SystemExit(f"--override drafter_steps expects a JSON object with keys from {DRAFTERS}, got {raw!r}")
            p = dataclasses.replace(p, **{parts[0]: val})
        else:
            raise SystemExit(f"--override: unknown key {key!r}")
    return p


# -- small utilities ---------------------------------------------------------------------------------
def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def gpu_name() -> str | None:
    """Without creating a CUDA context in this process (it must hold no device memory)."""
    if not shutil.which("nvidia-smi"):
        return None
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def peak_flops(name: str | None) -> float | None:
    return next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if name and k in name), None)


class GpuSampler:
    """nvidia-smi every ``period`` s in a thread: peak device memory and per-process peaks (processes of
    this script's tree named by their command line). A no-op without nvidia-smi (CPU)."""

    def __init__(self, period: float = 1.0):
        self.period, self.enabled = period, shutil.which("nvidia-smi") is not None
        self.peak_used = self.total = 0
        self.procs: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "GpuSampler":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _query(self, what: str) -> list[list[str]]:
        r = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        return [[x.strip() for x in line.split(",")] for line in r.stdout.splitlines() if line.strip()]

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.is_set():
            try:
                used, total = (int(float(x)) for x in self._query("gpu=memory.used,memory.total")[0][:2])
                self.peak_used, self.total = max(self.peak_used, used), total
                mine = {p.pid: p for p in me.children(recursive=True)}
                for pid_s, mib in self._query("compute-apps=pid,used_memory"):
                    pid, mib_i = int(pid_s), int(float(mib))
                    rec = self.procs.setdefault(pid, {"peak_mib": 0, "role": None})
                    rec["peak_mib"] = max(rec["peak_mib"], mib_i)
                    if rec["role"] is None and pid in mine:
                        rec["role"] = _role(mine[pid])
            except Exception as e:  # a sampler must never end a stage; the report says it failed
                self.procs.setdefault(-1, {"error": repr(e)})
            self._stop.wait(self.period)

    def summary(self) -> dict[str, Any] | None:
        if not self.enabled:
            return None
        return {"device_peak_used_mib": self.peak_used, "device_total_mib": self.total,
                "processes": {str(k): v for k, v in sorted(self.procs.items())}}


def _role(proc: Any) -> str:
    try:
        cmd = " ".join(proc.cmdline())
    except Exception:
        return "?"
    for needle, role in (("layertap.pipeline.evaluate", "evaluation engine (frontend)"),
                         ("EngineCore", "vLLM engine core"), ("layertap train", "trainer (layertap train)"),
                         ("layertap capture", "capture frontend"), ("train-offline", "offline trainer"),
                         ("_worker serve", "serving frontend"), ("_worker target", "target trainer")):
        if needle in cmd:
            return role
    return cmd[:80]


# -- the run's context: time, logs, subprocesses -------------------------------------------------------
NOISE = re.compile(r"^\s*$|^\((EngineCore|Worker|VllmWorker|APIServer|MainProcess)[^)]*\)|^(INFO|DEBUG|WARNING)\b|"
                   r"it/s\]|Loading safetensors|Writing model shards|^\[rank|^\[W\d|^Triton|Warning:|^\s+(if|wrapper) |"
                   r"^\||^!\[|^Idle fraction|^#|^target `|(?<!100)%\|")


class Deferred(Exception):
    """Not run in this invocation (its estimate does not fit in the time left, or it waits for another
    stage); a later invocation runs it. Later stages that fit still run."""


class DeadlineReached(Exception):
    """A running stage was stopped at the deadline: nothing else starts; the next invocation resumes it."""


@dataclass
class Run:
    profile: Profile
    work: Path
    out: Path
    deadline_s: float | None
    overrides: list[str] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.lock = threading.RLock()  # state, results and the log: two drafter stages may run at once
        for d in ("logs", "results", "report", "data"):
            (self.work / d).mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self._log = open(self.work / "gpu_loop.log", "a", encoding="utf-8")  # noqa: SIM115 - the run's log
        self.state: dict[str, Any] = read_json(self.work / "state.json") or {"calls": 0, "steps": {}}
        self.state["calls"] += 1
        write_json(self.work / "state.json", self.state)

    def mark(self, name: str, status: str, wall_s: float, error: str | None = None) -> None:
        """Record a stage's (or serve variant's) outcome in WORK/state.json, over all invocations."""
        with self.lock:
            st = self.state["steps"].setdefault(name, {"wall_s": 0.0, "attempts": 0})
            st.update(status=status, error=error, wall_s=round(st["wall_s"] + wall_s, 1), attempts=st["attempts"] + 1)
            write_json(self.work / "state.json", self.state)

    @property
    def failures(self) -> dict[str, str]:
        return {k: v["error"] for k, v in self.state["steps"].items() if v["status"] == "failed"}

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return float("inf") if self.deadline_s is None else self.deadline_s - self.elapsed()

    def log(self, msg: str) -> None:
        line = f"[gpu_loop {self.elapsed():6.0f}s] {msg}"
        with self.lock:
            print(line, flush=True)
            self._log.write(line + "\n")
            self._log.flush()

    def need(self, what: str, seconds: float) -> None:
        """Refuse to start ``what`` unless its estimate fits before the point where ``sh`` would stop it."""
        usable = self.left() - GRACE_S
        if seconds > usable:
            raise Deferred(f"{what} needs ~{seconds:.0f}s, {max(usable, 0):.0f}s usable before the deadline")

    def result(self, name: str) -> Any:
        return read_json(self.work / "results" / f"{name}.json")

    def save_result(self, name: str, obj: Any) -> None:
        with self.lock:
            write_json(self.work / "results" / f"{name}.json", obj)

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("VLLM_NO_USAGE_STATS", "1")
        # Engines forked after multi-threaded torch CPU work deadlock in OpenMP (README); the evaluation
        # children that `layertap train` starts inherit this too.
        env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if self.profile.device == "cuda":
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # flashinfer is not in the device bundle
        return {**env, **(extra or {})}

    def sh(self, name: str, cmd: list[str], *, env: dict[str, str] | None = None, grace: float = GRACE_S) -> tuple[int, float]:
        """Run ``cmd`` in its own process group, its output to logs/NAME.log (the useful lines echoed).
        ``grace`` s before the deadline the group gets SIGTERM (SIGKILL 40 s later), so even a stopped
        stage ends inside the deadline. Returns (exit status, wall seconds); 124 when the deadline stopped it."""
        logp = self.work / "logs" / f"{name}.log"
        self.log(f"{name}: {' '.join(cmd[1:] if cmd[0] == sys.executable else cmd)}")
        t0 = time.monotonic()
        with open(logp, "a", encoding="utf-8") as logf:
            logf.write(f"\n==== {datetime.now(timezone.utc).isoformat()} {' '.join(cmd)}\n")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                    env=env or self.env(), cwd=REPO, start_new_session=True, errors="replace")
            pump = threading.Thread(target=self._pump, args=(proc, logf, name), daemon=True)
            pump.start()
            timeout = max(self.left() - grace, 1.0) if self.deadline_s is not None else None
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.log(f"{name}: deadline: SIGTERM to its process group")
                rc = _stop_group(proc)
                rc = 124 if rc in (130, -signal.SIGTERM, -signal.SIGKILL) else rc
            pump.join(10)
        wall = time.monotonic() - t0
        self.log(f"{name}: exit {rc} after {wall:.0f}s")
        if rc not in (0, 124):
            tail = logp.read_text(errors="replace").splitlines()[-40:]
            self.log(f"{name}: last lines of {logp}:\n" + "\n".join("    " + t for t in tail))
        return rc, wall

    def _pump(self, proc: subprocess.Popen, logf: Any, name: str) -> None:
        echoed = 0
        tag = f"{name}: " if self.profile.parallel_drafters else ""  # two stages may echo at once
        for line in proc.stdout:  # type: ignore[union-attr]
            logf.write(line)
            text = line.rstrip("\n").split("\r")[-1]
            if echoed < 150 and not NOISE.search(text):
                echoed += 1
                print(f"    | {tag}{text[:200]}", flush=True)
        logf.flush()


def _group_pids(pgid: int) -> list[int]:
    """Living (not zombie) members of process group ``pgid``."""
    from layertap.engine.watchdog import _running

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid and _running(int(d)):
                    out.append(int(d))
            except OSError:  # gone meanwhile
                continue
    return out


def _stop_group(proc: subprocess.Popen) -> int:
    """SIGTERM the process group this script started for ``proc`` (its leader may have exited already;
    vLLM's engine core may not have), SIGKILL what is left after 40 s, then unlink the shared-memory queues
    the group mapped that nobody maps now (``watchdog.unlink_orphans``, as for every engine layertap stops).
    Returns the leader's exit status."""
    from layertap.engine.watchdog import mapped_segments, unlink_orphans

    pgid = proc.pid  # start_new_session: the child leads its own group
    segments = mapped_segments(_group_pids(pgid))
    for sig, wait in ((signal.SIGTERM, 40.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (proc.poll() is None or _group_pids(pgid)):
            time.sleep(0.05)
        if proc.poll() is not None and not _group_pids(pgid):
            break
    unlink_orphans(segments)
    return proc.wait()


# -- data --------------------------------------------------------------------------------------------
def ensure_data(run: Run, target: str) -> dict[str, Any]:
    """Conversations (JSONL, for ``layertap train``), the offline run's prompts (token ids, the same
    training conversations) and the held-out serving prompts; written once into WORK/data."""
    d = run.work / "data"
    meta = read_json(d / "data.json")
    if meta is not None:
        return meta
    from transformers import AutoTokenizer

    from layertap.models.train_target import write_conversations
    from layertap.train.data import prompt_of

    p = run.profile
    convs = write_conversations(d / "convs.jsonl", p.convs, seed=1)
    lines = [json.loads(x) for x in convs.read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(target)

    def ids(msgs: list[dict[str, str]]) -> list[int]:
        out = tok.apply_chat_template(prompt_of(msgs), tokenize=True, add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    train, held = lines[: len(lines) - p.holdout], lines[len(lines) - p.holdout :]
    (d / "train_prompts.jsonl").write_text("".join(json.dumps({"token_ids": ids(o["messages"])}) + "\n" for o in train))
    write_json(d / "serve_prompts.json", [ids(o["messages"]) for o in held])
    meta = {"convs": str(convs), "train_prompts": str(d / "train_prompts.jsonl"),
            "serve_prompts": str(d / "serve_prompts.json"), "num_train": len(train), "num_holdout": len(held)}
    write_json(d / "data.json", meta)
    return meta


def capture_layers(target: str) -> list[int]:
    """What ``layertap train`` captures for either drafter by default: its aux ids plus the last state."""
    from layertap.pipeline.build import default_aux_layers

    n = int(json.loads((Path(target) / "config.json").read_text())["num_hidden_layers"])
    return sorted(set(default_aux_layers(n)) | {n})


def target_path(run: Run) -> str:
    res = run.result("target")
    if res is None:
        raise StageFailed("the target stage has not run yet (include target in --stages)")
    return res["path"]


# -- stage: target -----------------------------------------------------------------------------------
def stage_target(run: Run) -> None:
    res_p = run.work / "results" / "target.worker.json"
    with GpuSampler() as gpu:
        rc, wall = run.sh("target", [sys.executable, __file__, "_worker", "target", run.profile.name,
                                     json.dumps(run.overrides), str(res_p)])
    if rc == 124:
        raise DeadlineReached("target training was stopped at the deadline; it starts again next time")
    if rc != 0:
        raise StageFailed(f"target training exited {rc}", rc)
    res = read_json(res_p)
    res["wall_s"], res["memory"] = round(wall, 1), gpu.summary()
    run.save_result("target", res)
    how = "cached" if res["cached"] else f"trained in {res['train_s']}s, {res['train_tokens_per_s']} tok/s"
    run.log(f"target: {res['path']} final loss {res['final_loss']:.3f} after {res['steps_done']} steps ({how})")


def worker_target(profile: str, overrides: str, result: str) -> int:
    import torch
    from safetensors import safe_open

    from layertap.models.tiny import default_cache_dir
    from layertap.models.train_target import _spec_key, trained_target

    p = apply_overrides(PROFILES[profile], json.loads(overrides))
    if p.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"profile {p.name} trains on CUDA, but torch sees no GPU")
    cached_dir = default_cache_dir() / f"target-qwen3-{_spec_key(p.target)}"
    cached = (cached_dir / "layertap_target.json").exists()
    t0 = time.monotonic()
    path = trained_target(p.target, device=p.device, dtype=p.target_dtype, time_budget_s=p.target_budget_s,
                          log_every=25)
    stamp = json.loads((path / "layertap_target.json").read_text())
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):  # one file, or shards
        with safe_open(str(file), "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    numel = {k: int(torch.tensor(s).prod()) for k, s in shapes.items()}
    spec = dataclasses.asdict(p.target)
    steps_done = stamp.get("steps_done", stamp["steps"])
    train_s = stamp.get("train_s")
    tokens = steps_done * p.target.batch_size * p.target.seq_len
    m = p.target.model
    body = sum(v for k, v in numel.items() if "embed_tokens" not in k)  # layers + final norm + lm_head
    # 6 N per token (forward + backward) plus causal attention: 6 x layers x seq x q-width per token.
    flops_tok = 6 * body + 6 * m.num_layers * p.target.seq_len * m.num_heads * m.head_dim
    tok_s = tokens / train_s if train_s else None
    peak = peak_flops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    write_json(Path(result), {
        "path": str(path), "cached": cached, "spec": spec, "dtype": stamp.get("dtype", "float32"),
        "device": stamp.get("device", "cpu"), "final_loss": stamp["final_loss"], "steps": stamp["steps"],
        "steps_done": steps_done, "train_s": train_s, "losses": stamp.get("losses"),
        "parameters": sum(numel.values()), "parameters_non_embedding": body,
        "train_tokens": tokens, "train_tokens_per_s": round(tok_s, 1) if tok_s else None,
        "train_mfu": round(flops_tok * tok_s / peak, 4) if tok_s and peak else None,
        "call_s": round(time.monotonic() - t0, 1)})
    return 0


# -- stages: eagle3, dflash (online) ---------------------------------------------------------------
class StageFailed(RuntimeError):
    def __init__(self, msg: str, rc: int = 1):
        super().__init__(msg)
        self.rc = rc


def _sets(d: dict[str, Any]) -> list[str]:
    out = []
    for k, v in d.items():
        out += ["--set", f"{k}={str(v).lower() if isinstance(v, bool) else v}"]
    return out


def steps_of(p: Profile, kind: str) -> int:
    return int(p.drafter_steps.get(kind, p.steps))


def train_sets(p: Profile, kind: str) -> dict[str, Any]:
    steps = steps_of(p, kind)
    s: dict[str, Any] = {
        "capture.transport": "shm", "capture.regenerate": True, "capture.max_tokens": p.capture_max_tokens,
        "capture.epochs": p.epochs, "capture.eval_holdout": p.holdout, "capture.max_inflight": p.max_inflight,
        "capture.shm_slot_mb": p.shm_slot_mb, "capture.shm_slots": p.shm_slots,
        "train.max_steps": steps, "train.batch_size": p.batch, "train.lr": p.lr[kind],
        "train.warmup_steps": p.warmup, "train.max_len": p.max_len, "train.save_every": p.save_every,
        "train.log_every": max(1, steps // 10), "train.device": p.device, "train.ttt_steps": p.ttt_steps,
        "train.block_size": p.block_size, "train.dflash_layers": p.dflash_layers,
        "eval.every": p.eval_every[kind], "eval.num_prompts": p.eval_prompts, "eval.max_tokens": p.eval_max_tokens,
        "eval.num_spec": p.num_spec, "eval.ngram_k": p.ngram_k, "eval.kv_cache_mb": p.eval_kv_mb,
    }
    s.update({f"engine.{k}": v for k, v in p.engine.items()})
    return s


def shm_slots_that_fit(run: Run) -> int:
    """The profile's pool, shrunk (loudly) when /dev/shm has less room; the Tap bounds in-flight requests
    by the pool's free capacity, so a smaller pool only slows capture."""
    p = run.profile
    free = shutil.disk_usage("/dev/shm").free if Path("/dev/shm").exists() else 0
    fit = int(0.6 * free) // (p.shm_slot_mb << 20)
    if fit >= p.shm_slots:
        return p.shm_slots
    if fit < 8:
        raise StageFailed(f"/dev/shm has {free >> 20} MiB free; the shm pool needs {p.shm_slots * p.shm_slot_mb} "
                          "MiB (mount -o remount,size=32G /dev/shm)")
    run.log(f"/dev/shm has {free >> 20} MiB free: shm pool shrunk to {fit} x {p.shm_slot_mb} MiB")
    return fit


def stage_online(run: Run, kind: str) -> None:
    p, target = run.profile, target_path(run)
    data = ensure_data(run, target)
    out = run.work / kind
    resume = (out / "run_config.json").exists()
    if (out / "report.json").exists():  # finished in an earlier call that ended before saving its result
        walls = read_json(out / "gpu_loop_partial.json") or {"wall_s": 0.0, "calls": 0}
        run.save_result(kind, online_result(run, kind, out, walls, None))
        return
    if resume:
        cmd = [sys.executable, "-m", "layertap", "train", "--out", str(out), "--resume"]
        run.log(f"{kind}: resuming the interrupted run in {out}")
    else:
        sets = {**train_sets(p, kind), "capture.shm_slots": shm_slots_that_fit(run)}
        cmd = [sys.executable, "-m", "layertap", "train", "--target", target, "--data", data["convs"],
               "--drafter", kind, "--out", str(out), *_sets(sets)]
    # Drafter stages running at once compile the same target: each gets its own compile cache.
    env = run.env({"VLLM_CACHE_ROOT": str(run.work / "vllm-cache" / f"train-{kind}")}) if p.parallel_drafters else None
    with GpuSampler() as gpu:
        rc, wall = run.sh(kind, cmd, env=env)
    prev = read_json(out / "gpu_loop_partial.json") or {"wall_s": 0.0, "calls": 0}
    prev = {"wall_s": prev["wall_s"] + wall, "calls": prev["calls"] + 1,
            "memory": [*prev.get("memory", []), gpu.summary()]}  # each call's peaks: a resumed run keeps all
    write_json(out / "gpu_loop_partial.json", prev)
    if rc == 124:
        raise DeadlineReached(f"{kind} was stopped at the deadline; it resumes next time")
    if rc != 0:
        raise StageFailed(f"layertap train --drafter {kind} exited {rc}", rc)
    run.save_result(kind, online_result(run, kind, out, prev, merge_memory(prev["memory"])))
    r = run.result(kind)
    run.log(f"{kind}: {r['steps']} steps, final loss {r['final_loss']:.4f}, AL in training eval "
            f"{r['train_eval_acceptance_length']}, idle {r['trainer_idle_fraction']}, MFU {r['mfu']}")


def merge_memory(calls: list[Any]) -> Any:
    """GpuSampler summaries of the device calls one stage took, as one: the highest device peak, each
    process's peak (processes of different calls are different pids)."""
    calls = [c for c in calls if c]
    if len(calls) <= 1:
        return calls[0] if calls else None
    return {"device_peak_used_mib": max(c["device_peak_used_mib"] for c in calls),
            "device_total_mib": calls[0]["device_total_mib"],
            "processes": {k: v for c in calls for k, v in c.get("processes", {}).items()}, "calls": len(calls)}


def online_result(run: Run, kind: str, out: Path, walls: dict[str, Any], memory: Any) -> dict[str, Any]:
    p = run.profile
    rep = json.loads((out / "report.json").read_text())
    hist = read_json(out / "history.json") or []
    rates = rep["rates_total"]  # summed over the run's invocations (a resumed run has several)
    final = {r["name"]: r for r in (rep.get("acceptance") or {}).get("results", [])}
    # Every evaluation the run made, also those of an earlier, interrupted part (their result files stay).
    evals = [*rep.get("acceptance_curve", []), *(read_json(f) for f in sorted((out / "evals").glob("result-*.json")))]
    curve = sorted({(int(e["step"]), float(r["mean_acceptance_length"]))
                    for e in evals for r in e.get("results", []) if r["name"] == kind})
    cons = float(rates["consumer_wall_s"])
    tokens = float(rates["consumer_tokens"])
    busy = cons * (1.0 - float(rates["trainer_idle_fraction"]))
    export = out / "exports" / "final"
    conf = json.loads((export / "config.json").read_text())
    mean_len = tokens / max(rates["consumer_records"], 1)
    fpt = (eagle3_flops_per_token(conf, p.ttt_steps, mean_len) if kind == "eagle3"
           else dflash_flops_per_token(conf, p.anchors, mean_len))
    busy_tok_s = tokens / busy if busy > 0 else None
    peak = peak_flops(gpu_name()) if p.device == "cuda" else None
    return {
        "kind": kind, "out": str(out), "export": str(export), "wall_s": round(walls["wall_s"], 1),
        "device_calls": walls["calls"], "resumed": walls["calls"] > 1, "report_wall_s": rep["wall_s"],
        "rates_note": "rates summed over the run's invocations" if walls["calls"] > 1 else None,
        "steps": rep["steps"],
        "inputs_trained": rep["inputs_trained"], "layers": rep["layers"], "transport": rep["transport"],
        "final_loss": rep.get("final_loss"), "loss_curve": [[m["step"], m["loss"]] for m in hist],
        "acc_curve": [[m["step"], m["acc"]] for m in hist],
        "train_eval_acceptance_length": final.get(kind, {}).get("mean_acceptance_length"),
        "train_eval_ngram_acceptance_length": final.get("ngram", {}).get("mean_acceptance_length"),
        "train_eval_outputs_match_plain": final.get(kind, {}).get("outputs_match_plain"),
        "acceptance_curve": [list(x) for x in curve], "evals_skipped": rep.get("evals_skipped", []),
        "rates": rates, "trainer_idle_fraction": rates["trainer_idle_fraction"],
        "trainer_tokens_per_s": round(tokens / cons, 1) if cons > 0 else None,
        "trainer_busy_tokens_per_s": round(busy_tok_s, 1) if busy_tok_s else None,
        "records_per_s": rates["producer_records_per_s"], "consumer_records_per_s": rates["consumer_records_per_s"],
        "flops_per_token": fpt, "mfu": round(fpt * busy_tok_s / peak, 4) if busy_tok_s and peak else None,
        "memory": memory,
    }


def _dims(conf: dict[str, Any]) -> tuple[int, int, int, int, int]:
    h, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
    d = int(conf.get("head_dim") or h // heads)
    return h, heads * d, int(conf["num_key_value_heads"]) * d, int(conf["intermediate_size"]), int(conf["vocab_size"])


def eagle3_flops_per_token(conf: dict[str, Any], ttt: int, seq: float) -> float:
    """Model FLOPs per trained token (as benchmarks/train_throughput.py counts them): per unroll step
    2 x (qkv over [embed; g] (2H wide) + o + MLP + draft lm_head) + causal attention 2 x 2 x (T/2) x q;
    fc once; x3 for forward + backward; the frozen target head's labels 2 x H x V, forward only."""
    h, q, kv, inter, vocab = _dims(conf)
    n_aux = len(conf.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * inter
    per_step = 2 * (layer + h * int(conf["draft_vocab_size"])) + 2 * 2 * (seq / 2) * q
    return float(3 * (ttt * per_step + 2 * n_aux * h * h) + 2 * h * vocab)


def dflash_flops_per_token(conf: dict[str, Any], anchors: int, seq: float) -> float:
    """Model FLOPs per record token: fc and every layer's context K/V over all T tokens; A anchors x B
    block tokens through the layers (dense attention over T context + B block keys, masked) and the
    frozen target lm_head; x3 for forward + backward (the lm_head x2: input gradients only). A is taken
    as min(anchors, T/2) (about the answer's share of a record): an approximation, stated as such."""
    h, q, kv, inter, vocab = _dims(conf)
    layers = int(conf["num_hidden_layers"])
    bs = int(conf.get("block_size", 8))
    n_ctx = len((conf.get("dflash_config") or {}).get("target_layer_ids") or conf.get("aux_hidden_state_layer_ids"))
    a = min(anchors, seq / 2)
    per_block_tok = layers * (2 * (h * q + 2 * h * kv + q * h + 3 * h * inter) + 4 * q * (seq + bs))
    per_record = (2 * n_ctx * h * h * seq + layers * 2 * h * 2 * kv * seq + a * bs * per_block_tok) * 3 \
        + a * bs * 2 * h * vocab * 2
    return float(per_record / max(seq, 1.0))


# -- stage: offline ----------------------------------------------------------------------------------
def engine_flags(d: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for k, v in d.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        elif v is not False:
            out += [flag, str(v)]
    return out


def check_disk(run: Run, where: Path, prompts_path: Path, target: str) -> None:
    """The dataset holds every captured row: tokens x planes x hidden x 2 bytes (bf16/fp16 engines; fp32
    twice that). Fail before the engine starts when the disk cannot take it."""
    c = json.loads((Path(target) / "config.json").read_text())
    prompts = [json.loads(x)["token_ids"] for x in prompts_path.read_text().splitlines()]
    rows = sum(len(x) for x in prompts) + len(prompts) * run.profile.capture_max_tokens
    est = rows * len(capture_layers(target)) * int(c["hidden_size"]) * 4  # fp32 bound; bf16 halves it
    free = shutil.disk_usage(where).free
    run.log(f"offline: the dataset needs <= {est / 2**30:.1f} GiB ({est / 2**31:.1f} in bf16); {free / 2**30:.1f} GiB free")
    if free < 0.55 * est:
        raise StageFailed(f"{where} has {free / 2**30:.1f} GiB free; the offline dataset needs about "
                          f"{est / 2**31:.1f} GiB (bf16)")


def offline_inputs(run: Run, data: dict[str, Any], base: Path) -> tuple[Path, int]:
    """(prompts file, max steps) of the offline run: the first ``offline_records`` training prompts (the
    online run's inputs, in file order) and the steps they fill, or all of them and EAGLE-3's steps."""
    p = run.profile
    src = Path(data["train_prompts"])
    n = p.offline_records
    if n is None or n >= data["num_train"]:
        return src, steps_of(p, "eagle3")
    dst = base / f"prompts-{n}.jsonl"
    if not dst.exists():
        lines = src.read_text().splitlines()[:n]
        tmp = dst.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in lines))
        os.replace(tmp, dst)
    return dst, min(steps_of(p, "eagle3"), max(1, n // p.batch))


def stage_offline(run: Run) -> None:
    p, target = run.profile, target_path(run)
    data = ensure_data(run, target)
    base = run.work / "offline"
    base.mkdir(exist_ok=True)
    ds, tr = base / "dataset", base / "train"
    walls = read_json(base / "walls.json") or {"capture_s": 0.0, "train_s": 0.0, "calls": 0}
    layers = ",".join(str(i) for i in capture_layers(target))
    eng = dict(p.engine) if p.device == "cuda" else {"enforce_eager": True, "max_model_len": 1024,
                                                      "kv_cache_memory_bytes": 128 << 20}
    prompts, steps = offline_inputs(run, data, base)
    if not (base / "capture.done").exists():
        check_disk(run, ds.parent, prompts, target)
        cmd = [sys.executable, "-m", "layertap", "capture", "--model", target, "--data", str(prompts),
               "--layers", layers, "--out", str(ds), "--mode", "generate", "--max-tokens", str(p.capture_max_tokens),
               "--max-inflight", str(p.max_inflight), *engine_flags(eng)]
        with GpuSampler() as gpu:
            rc, wall = run.sh("offline-capture", cmd)
        walls["capture_s"] += wall
        walls["calls"] += 1
        write_json(base / "walls.json", walls)
        if rc == 124:
            raise DeadlineReached("offline capture was stopped at the deadline; it resumes next time")
        rejected = len((ds / "rejected.jsonl").read_text().splitlines()) if (ds / "rejected.jsonl").exists() else 0
        if rc == 1 and rejected:  # capture exits 1 when it refused inputs by name (too long); the online run
            run.log(f"offline capture: {rejected} inputs refused as too long (the online run counts them too)")
        elif rc != 0:
            raise StageFailed(f"layertap capture exited {rc}", rc)
        write_json(base / "capture.done", {"memory": gpu.summary(), "rejected": rejected})
    run.need("offline training", 0.4 * p.estimates["offline"])
    cmd = [sys.executable, "-m", "layertap", "train-offline", str(ds), "--kind", "eagle3", "--out", str(tr),
           "--target", target, "--epochs", str(p.epochs), "--max-steps", str(steps), "--batch-size", str(p.batch),
           "--lr", str(p.lr["eagle3"]), "--warmup", str(p.warmup), "--max-len", str(p.max_len),
           "--ttt-steps", str(p.ttt_steps), "--save-every", str(p.save_every),
           "--log-every", str(max(1, steps // 10)), "--no-tensorboard", "--device", p.device,
           *(["--resume"] if (tr / "checkpoint.pt").exists() else [])]
    rc, wall = run.sh("offline-train", cmd)
    walls["train_s"] += wall
    write_json(base / "walls.json", walls)
    if rc == 124:
        raise DeadlineReached("offline training was stopped at the deadline; it resumes next time")
    if rc != 0:
        raise StageFailed(f"layertap train-offline exited {rc}", rc)
    rc, _ = run.sh("offline-export", [sys.executable, "-m", "layertap", "export", str(tr / "checkpoint.pt"),
                                      str(base / "export")])
    if rc != 0:
        raise StageFailed(f"layertap export exited {rc}", rc)
    hist = read_json(tr / "history.json") or []
    from layertap.transport.file import load_records

    recs = load_records(ds)
    n_rec = len(recs)
    res = {
        "capture_wall_s": round(walls["capture_s"], 1), "train_wall_s": round(walls["train_s"], 1),
        "total_wall_s": round(walls["capture_s"] + walls["train_s"], 1), "dataset_bytes": dir_bytes(ds),
        "dataset_records": n_rec, "dataset_dir": str(ds), "layers": [int(x) for x in layers.split(",")],
        "store_dtype": str(recs[0].hidden_states.dtype).removeprefix("torch.") if n_rec else None,
        "steps": hist[-1]["step"] if hist else 0,
        "final_loss": hist[-1]["loss"] if hist else None, "loss_curve": [[m["step"], m["loss"]] for m in hist],
        "export": str(base / "export"), "capture_memory": (read_json(base / "capture.done") or {}).get("memory"),
        "capture_rejected": (read_json(base / "capture.done") or {}).get("rejected", 0),
        "inputs": len(prompts.read_text().splitlines()), "max_steps": steps,
    }
    run.save_result("offline", res)
    run.log(f"offline: capture {res['capture_wall_s']}s ({n_rec} records, {res['dataset_bytes'] / 2**20:.1f} MiB), "
            f"train {res['train_wall_s']}s, final loss {res['final_loss']}")


# -- stage: serve ------------------------------------------------------------------------------------
def serve_spec(run: Run, variant: str) -> tuple[dict[str, Any] | None, dict[str, str], str | None]:
    """(speculative_config, extra env, why it cannot run) of a serving variant."""
    from layertap.drafters.export import speculative_config

    p = run.profile
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if variant.endswith("-v1") else {}
    if variant in ("plain", "plain-v1"):
        return None, env, None
    if variant == "ngram":
        return {"method": "ngram", "num_speculative_tokens": p.ngram_k, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}, {}, None
    drafter = variant_drafter(variant)
    if drafter is None or not known_variant(variant):
        raise ValueError(f"serve: unknown variant {variant!r}")
    src = run.work / ("offline/export" if drafter == "offline" else f"{drafter}/exports/final")
    if not (src / "config.json").exists():
        return None, {}, f"no exported drafter at {src} (its stage has not completed)"
    kind = json.loads((src / "config.json").read_text())["layertap"]["kind"]
    k = K_VARIANT.fullmatch(variant)
    num_spec = int(k.group(2)) if k else p.num_spec if kind == "eagle3" else None
    return speculative_config(src, num_spec), env, None


SERVE_MSG = "@@layertap-serve "
"""Prefix of the serve workers' protocol lines on stdout (vLLM logs to the same stream)."""
SERVE_STEP_TIMEOUT_S = 600.0
"""Longest a serve worker may take to start its engine, or to time one concurrency once."""


class ServeWorker:
    """One serving variant's engine in its own process (vLLM's counters are process-global), alive for the
    whole stage and driven over stdin/stdout: ``{"batch": b}`` times b in flight once and answers."""

    def __init__(self, run: Run, variant: str, job: Path, result: Path, env: dict[str, str]) -> None:
        import queue

        self.variant, self.result = variant, result
        self.logp = run.work / "logs" / f"serve-{variant}.log"
        self.logf = open(self.logp, "a", encoding="utf-8")
        self.logf.write(f"\n==== {datetime.now(timezone.utc).isoformat()} serve worker {variant}\n")
        self.proc = subprocess.Popen([sys.executable, __file__, "_worker", "serve", str(job), str(result)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, env=env, cwd=REPO, start_new_session=True,
                                     errors="replace")
        self.msgs: queue.Queue = queue.Queue()
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.pump.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self.logf.write(line)
            if line.startswith(SERVE_MSG):
                self.msgs.put(json.loads(line[len(SERVE_MSG):]))
        self.logf.flush()
        self.msgs.put(None)  # end of output: the worker exited

    def ask(self, cmd: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        """Send ``cmd`` (None: only wait) and return the worker's next message; a worker that exits or does
        not answer within ``timeout`` s is a named error (and is stopped)."""
        import queue

        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        try:
            msg = self.msgs.get(timeout=timeout)
        except queue.Empty:
            self.stop()
            raise TimeoutError(f"serve {self.variant}: no answer to {cmd} within {timeout:.0f} s") from None
        if msg is None:
            rc = self.proc.wait(30)
            raise RuntimeError(f"serve {self.variant}: the worker exited ({rc}) before answering {cmd}; "
                               f"see {self.logp}")
        if "error" in msg:
            raise RuntimeError(f"serve {self.variant}: {msg['error']}")
        return msg

    def finish(self, timeout: float) -> int:
        try:
            self.ask({"op": "quit"}, timeout)
        finally:
            rc = self.stop(grace=timeout)
        return rc

    def stop(self, grace: float = 10.0) -> int:
        """Wait ``grace`` s for the worker to exit, else stop its process group; idempotent."""
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        rc = _stop_group(self.proc)  # also whatever of its group outlived it (vLLM's engine core)
        self.pump.join(10)
        if not self.logf.closed and not self.pump.is_alive():
            self.logf.close()
        return rc


def stage_serve(run: Run, variants: tuple[str, ...]) -> None:
    """Every variant's engine alive at once, each in its own worker process, timed in interleaved rounds:
    a round measures each concurrency on every variant back to back (the order rotated each round), so each
    speed-up is a ratio of two measurements made seconds apart, not minutes or an engine start apart. A
    drafter variant whose export does not exist yet defers the stage; one whose stage failed is left out; a
    variant whose worker fails is marked failed and the others go on (plain must not fail)."""
    p, target = run.profile, target_path(run)
    data = ensure_data(run, target)
    d = run.work / "serve"
    d.mkdir(exist_ok=True)
    waiting, ready = [], []
    prompts = json.loads(Path(data["serve_prompts"]).read_text())
    for v in variants:
        spec, env, why = serve_spec(run, v)
        if why and run.state["steps"].get(variant_drafter(v) or "", {}).get("status") == "failed":
            run.log(f"serve {v}: left out: its drafter's stage failed ({why})")
        elif why:
            run.log(f"serve {v}: waits: {why}")
            waiting.append(v)
        else:
            ready.append((v, spec, env))
    if waiting:
        raise Deferred(f"serve: {', '.join(waiting)} wait for their drafters' stages")
    if "plain" not in [v for v, _, _ in ready]:
        raise StageFailed("serve: the plain baseline is not among the variants")
    run.need("serve", p.estimates["serve"])
    workers: dict[str, ServeWorker] = {}
    failed: dict[str, str] = {}
    t0 = time.monotonic()
    try:
        for v, spec, env in ready:
            job = {"variant": v, "target": target, "spec": spec, "engine": p.serve_engine, "prompts": prompts,
                   "batch_sizes": list(p.serve_batches),
                   "prompts_per_batch": {str(k): n for k, n in p.serve_prompts.items()},
                   "max_tokens": p.serve_max_tokens,
                   "profile_dir": str(d / "profile" / v) if v in p.serve_profile else None}
            write_json(d / f"{v}.job.json", job)
            (d / f"{v}.json").unlink(missing_ok=True)
            # Engines compiling at the same moment get their own compile caches (no two writers of one entry).
            cache = {"VLLM_CACHE_ROOT": str(run.work / "vllm-cache" / f"serve-{v}")}
            workers[v] = ServeWorker(run, v, d / f"{v}.job.json", d / f"{v}.json", run.env({**env, **cache}))
        run.log(f"serve: {len(workers)} engines starting at once: {', '.join(workers)}")
        for v, w in list(workers.items()):  # all start together; wait for each in turn
            try:
                m = w.ask(None, min(SERVE_STEP_TIMEOUT_S, max(run.left() - GRACE_S, 1.0)))
                run.log(f"serve {v}: engine ready after {time.monotonic() - t0:.0f}s (runner {m.get('model_runner')})")
            except Exception as e:
                failed[v] = str(e)
                workers.pop(v).stop()
                run.log(f"serve {v}: FAILED at start: {e}")
        if "plain" not in workers:
            raise StageFailed(f"serve: the plain baseline failed: {failed.get('plain')}")
        names = list(workers)
        for r in range(p.serve_repeats):
            for b in p.serve_batches:
                order = names[r % len(names):] + names[: r % len(names)]
                line = []
                for v in order:
                    if v not in workers:
                        continue
                    if run.deadline_s is not None and run.left() < GRACE_S:
                        raise DeadlineReached("serve stopped at the deadline; the whole stage runs again next time")
                    try:
                        m = workers[v].ask({"batch": b}, SERVE_STEP_TIMEOUT_S)
                        line.append(f"{v} {m['output_tokens_per_s']:.0f}")
                    except Exception as e:
                        failed[v] = str(e)
                        workers.pop(v).stop()
                        run.log(f"serve {v}: FAILED at b={b}: {e}")
                run.log(f"serve round {r + 1}/{p.serve_repeats} b={b}: " + ", ".join(line) + " tok/s")
        # Untimed, after the rounds: profiles, then plain's top-2 margins (each skipped, logged, without time).
        extra = [(v, {"op": "profile", "n": min(4, p.serve_prompts[min(p.serve_batches)])}) for v in names
                 if v in p.serve_profile]
        extra += [("plain", {"op": "margins", "n": p.margin_prompts})] if p.margin_prompts else []
        for v, cmd in extra:
            if v not in workers:
                continue
            if run.deadline_s is not None and run.left() < GRACE_S + 60:
                run.log(f"serve {v}: {cmd['op']} skipped: {run.left():.0f}s left before the deadline")
                continue
            t1 = time.monotonic()
            try:
                m = workers[v].ask(cmd, SERVE_STEP_TIMEOUT_S)
                run.log(f"serve {v}: {cmd['op']} " + (f"FAILED: {m['failed']}" if "failed" in m else "done")
                        + f" in {time.monotonic() - t1:.0f}s")
            except Exception as e:  # a dead or silent worker: its timed rounds are lost with it
                failed[v] = str(e)
                workers.pop(v).stop()
                run.log(f"serve {v}: FAILED at {cmd['op']}: {e}")
        for v, w in list(workers.items()):
            try:
                rc = w.finish(120)
                if rc != 0 or not (d / f"{v}.json").exists():
                    raise RuntimeError(f"exit {rc}, no result file")
            except Exception as e:
                failed[v] = str(e)
            workers.pop(v)
    finally:
        for w in workers.values():
            w.stop(grace=0.1)
    wall = time.monotonic() - t0
    for v, why in failed.items():
        write_json(d / f"{v}.failed", {"error": why, "log": str(run.work / "logs" / f"serve-{v}.log")})
        run.mark(f"serve-{v}", "failed", wall, why)
    if "plain" in failed:
        raise StageFailed(f"serve: the plain baseline failed: {failed['plain']}")
    for v, _, _ in ready:
        if v not in failed:
            run.mark(f"serve-{v}", "done", wall)
            r = json.loads((d / f"{v}.json").read_text())
            run.log(f"serve {v}: " + ", ".join(f"b{b} {x['output_tokens_per_s']:.0f} tok/s" for b, x in r["batches"].items())
                    + (f", AL {r['acceptance_length']:.3f}" if r.get("acceptance_length") else ""))
    run.save_result("serve", serve_summary(run, variants))
    if failed:
        raise StageFailed(f"serve: {', '.join(failed)} failed (logs/serve-VARIANT.log)")


def _sum_acceptance(acc: list[dict[str, Any]]) -> dict[str, Any]:
    """Acceptance results (``SpecResult`` as dicts) of several runs as one: counts summed, per-position
    rates weighted by each run's drafts."""
    drafts, accepted = sum(a["drafts"] for a in acc), sum(a["accepted"] for a in acc)
    k = max(len(a["per_pos"]) for a in acc)
    per_pos = [sum(a["per_pos"][i] * a["drafts"] for a in acc if i < len(a["per_pos"])) / max(drafts, 1)
               for i in range(k)]
    return {"drafts": drafts, "accepted": accepted, "per_pos": per_pos,
            "draft_tokens": sum(a["draft_tokens"] for a in acc), "mean_acceptance_length": 1.0 + accepted / max(drafts, 1)}


def _merge_decodes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency's single-repeat ``timed_decode`` results (one per round) as one result: seconds and
    output tokens per round, outputs of the first, acceptance summed over all."""
    import statistics

    first = runs[0]
    res = {**{k: first[k] for k in ("batch_size", "mode", "num_prompts", "max_tokens", "outputs")},
           "repeats": len(runs), "seconds": [x["seconds"][0] for x in runs],
           "output_tokens": [x["output_tokens"][0] for x in runs]}
    res["output_tokens_per_s"] = sum(res["output_tokens"]) / max(sum(res["seconds"]), 1e-9)
    med = [x["tpot_ms_median"] for x in runs if x.get("tpot_ms_median") is not None]
    p99 = [x["tpot_ms_p99"] for x in runs if x.get("tpot_ms_p99") is not None]
    res["tpot_ms_median"] = statistics.median(med) if med else None
    res["tpot_ms_p99"] = max(p99) if p99 else None
    if "acceptance" in first:
        res["acceptance"] = {**first["acceptance"], **_sum_acceptance([x["acceptance"] for x in runs])}
    return res


def worker_serve(job_path: str, result_path: str) -> int:
    """A serve worker (``ServeWorker``): start the engine, warm up, answer SERVE_MSG lines to the commands
    on stdin, write the merged results to ``result_path`` on ``{"op": "quit"}``."""
    import gc

    import vllm
    from vllm import LLM

    from layertap.pipeline.evaluate import timed_decode

    def say(obj: dict[str, Any]) -> None:
        print(SERVE_MSG + json.dumps(obj), flush=True)

    job = json.loads(Path(job_path).read_text())
    kw = {**job["engine"], "disable_log_stats": False}
    if job["spec"] is not None:
        kw["speculative_config"] = job["spec"]
    if job.get("profile_dir"):  # nothing is recorded until {"op": "profile"}
        from vllm.config import ProfilerConfig

        Path(job["profile_dir"]).mkdir(parents=True, exist_ok=True)
        kw["profiler_config"] = ProfilerConfig(profiler="torch", torch_profiler_dir=job["profile_dir"],
                                               torch_profiler_with_stack=False, torch_profiler_use_gzip=True,
                                               torch_profiler_record_shapes=False)
    t0 = time.monotonic()
    try:
        llm = LLM(model=job["target"], **kw)
    except Exception as e:
        say({"error": f"engine start failed: {type(e).__name__}: {e}"})
        raise
    start_s = time.monotonic() - t0
    cfg = getattr(llm.llm_engine, "vllm_config", None)
    v2 = getattr(cfg, "use_v2_model_runner", None)
    prompts, spec = job["prompts"], job["spec"] is not None
    # Warm-up at every concurrency (CUDA graphs are captured at start-up, but the first steps of a shape still
    # pay for lazy initialisation; one batch of all prompts stopping together never runs a batch of 1),
    # none of it timed or counted (timed_decode snapshots the counters itself).
    for b in job["batch_sizes"]:
        timed_decode(llm, prompts[:b], batch_size=b, max_tokens=min(16, job["max_tokens"]), speculative=False)
    res: dict[str, Any] = {"variant": job["variant"], "vllm_version": vllm.__version__, "engine_start_s": round(start_s, 1),
                           "model_runner": None if v2 is None else ("V2" if v2 else "V1"), "spec": job["spec"],
                           "engine": job["engine"], "batches": {}}
    say({"ready": True, "engine_start_s": res["engine_start_s"], "model_runner": res["model_runner"]})
    runs: dict[str, list[dict[str, Any]]] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            break
        if cmd.get("op") in ("profile", "margins"):
            try:
                if cmd["op"] == "profile":
                    res["profile"] = profile_decode(llm, job, prompts[:int(cmd["n"])], spec)
                else:  # batch 1, untimed, with plain's top-2 logprobs at every position
                    r = timed_decode(llm, prompts[:int(cmd["n"])], batch_size=1, max_tokens=job["max_tokens"],
                                     speculative=False, top2=True)
                    res["margins"] = {"outputs": r["outputs"], "top2": r["top2"]}
            except Exception as e:  # the timed results stand: kept, with the reason this part is missing
                res[f"{cmd['op']}_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
                say({"op": cmd["op"], "failed": res[f"{cmd['op']}_error"]})
                continue
            say({"op": cmd["op"], "done": True})
            continue
        b = int(cmd["batch"])
        n = int(job["prompts_per_batch"][str(b)])
        try:
            r = timed_decode(llm, prompts[:n], batch_size=b, max_tokens=job["max_tokens"], speculative=spec)
        except Exception as e:
            say({"error": f"b={b}: {type(e).__name__}: {e}"})
            raise
        runs.setdefault(str(b), []).append(r)
        say({"batch": b, "output_tokens_per_s": r["output_tokens_per_s"], "seconds": r["seconds"][0]})
    res["batches"] = {b: _merge_decodes(x) for b, x in runs.items()}
    if spec and res["batches"]:
        tot = _sum_acceptance([x["acceptance"] for x in res["batches"].values()])
        res.update(acceptance_length=tot["mean_acceptance_length"], per_pos=tot["per_pos"], drafts=tot["drafts"],
                   accepted=tot["accepted"])
    write_json(Path(result_path), res)
    say({"done": True})
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # the process exits next; vLLM's own atexit stops the engine too
        pass
    del llm
    gc.collect()
    return 0


def profile_decode(llm: Any, job: dict[str, Any], prompts: list[list[int]], spec: bool) -> dict[str, Any]:
    """One batch-1 ``timed_decode`` of ``prompts`` under vLLM's torch profiler (the engine's worker process),
    summarized per output token by ``trace_summary``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trace_summary import summarize

    from layertap.pipeline.evaluate import timed_decode

    prefix = f"serve_{job['variant']}_b1"
    llm.start_profile(profile_prefix=prefix)
    try:
        r = timed_decode(llm, prompts, batch_size=1, max_tokens=job["max_tokens"], speculative=spec)
    finally:
        llm.stop_profile()
    traces = sorted((t for t in Path(job["profile_dir"]).rglob("*.json*") if t.name.startswith(prefix)),
                    key=lambda t: t.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"no trace named {prefix}* under {job['profile_dir']}")
    n = r["output_tokens"][0]
    out = {"batch": 1, "prompts": len(prompts), "output_tokens": n, "seconds_profiled": r["seconds"][0],
           "trace": str(traces[-1]), "per": "output token", "summary": summarize(traces[-1], requests=n)}
    if spec:
        out["acceptance_length"] = r["acceptance"]["mean_acceptance_length"]
    return out


LOG_FACTS = re.compile(r"cuda ?graph|asynchronous scheduling|attention backend|using \S+ backend|speculative|"
                       r"eagle|dflash|draft|model runner|compilation|cudagraph_mode", re.I)


LOG_NOISE = ("SpecDecoding metrics", "cache directory", "saved AOT compiled")


def engine_log_facts(path: Path, limit: int = 40) -> list[str]:
    """The start-up lines of a serve worker's log that say how the engine runs (CUDA graphs, async
    scheduling, attention backend, the drafter), without their timestamps, once each."""
    seen: dict[str, None] = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            # (not progress bars, not the rows of a profiler's op table)
            if (LOG_FACTS.search(line) and not line.startswith((SERVE_MSG, "==== ")) and "%|" not in line
                    and " " * 8 not in line and not any(x in line for x in LOG_NOISE)):
                seen.setdefault(re.sub(r"^.*?\] ", "", line.strip())[:300], None)
                # The engine's config line is long; its CUDA graph mode sits near the end.
                for m in re.finditer(r"'cudagraph_mode': [^,]+", line):
                    seen.setdefault(m.group(0), None)
            if len(seen) >= limit:
                break
    return list(seen)


def divergences(outputs: list[list[int]], ref: dict[str, Any]) -> dict[str, Any]:
    """Where the first ``len(ref)`` ``outputs`` first differ from plain's batch-1 outputs, with plain's top-2
    margin there and whether the token taken was plain's runner-up."""
    from layertap.pipeline.evaluate import first_divergence

    rows = []
    for i, (out, want, top2) in enumerate(zip(outputs, ref["outputs"], ref["top2"])):
        pos = first_divergence(out, want)
        if pos is None:
            continue
        if pos < len(want) and pos < len(out):
            margin, second = top2[pos]
            rows.append({"prompt": i, "position": pos, "margin": round(margin, 4), "took_runner_up": out[pos] == second})
        else:  # one is a prefix of the other: no token to place against plain's margin, but a divergence
            rows.append({"prompt": i, "position": pos, "margin": None, "took_runner_up": None})
    margins = sorted(r["margin"] for r in rows if r["margin"] is not None)
    placed = [r for r in rows if r["margin"] is not None]
    return {"compared": min(len(outputs), len(ref["outputs"])), "diverged": len(rows),
            "length_only": len(rows) - len(placed), "max_margin": margins[-1] if margins else None,
            "median_margin": margins[len(margins) // 2] if margins else None,
            "runner_up_share": sum(r["took_runner_up"] for r in placed) / len(placed) if placed else None, "rows": rows}


def serve_summary(run: Run, variants: tuple[str, ...]) -> dict[str, Any]:
    import statistics

    d = run.work / "serve"
    res = {v: json.loads((d / f"{v}.json").read_text()) for v in variants if (d / f"{v}.json").exists()}
    plain = res["plain"]["batches"]
    out: dict[str, Any] = {"batch_sizes": list(run.profile.serve_batches), "variants": {}}
    for v, r in res.items():
        b = r["batches"]
        tok_s = {k: x["output_tokens_per_s"] for k, x in b.items()}
        per_rep = {k: [n / s for n, s in zip(x["output_tokens"], x["seconds"])] for k, x in b.items()}
        plain_rep = {k: [n / s for n, s in zip(x["output_tokens"], x["seconds"])] for k, x in plain.items()}
        eq = {k: sum(o == q for o, q in zip(x["outputs"], plain[k]["outputs"])) / max(len(x["outputs"]), 1)
              for k, x in b.items()}
        out["variants"][v] = {
            "model_runner": r["model_runner"], "engine_start_s": r["engine_start_s"], "vllm_version": r["vllm_version"],
            "output_tokens_per_s": tok_s, "output_tokens_per_s_by_repeat": per_rep,
            # Round r of a variant was timed right beside round r of plain (stage_serve): ratios per round.
            "speedup_by_round": {k: [x / y for x, y in zip(per_rep[k], plain_rep[k])] for k in per_rep},
            "speedup": {k: statistics.median([x / y for x, y in zip(per_rep[k], plain_rep[k])]) for k in per_rep},
            "speedup_range": {k: [min(x / y for x, y in zip(per_rep[k], plain_rep[k])),
                                  max(x / y for x, y in zip(per_rep[k], plain_rep[k]))] for k in per_rep},
            "outputs_equal_plain": eq,
            "tpot_ms_median": {k: x.get("tpot_ms_median") for k, x in b.items()},
            "tpot_ms_p99": {k: x.get("tpot_ms_p99") for k, x in b.items()},
            "output_tokens": {k: x["output_tokens"][0] for k, x in b.items()},
            "acceptance_length": r.get("acceptance_length"), "per_position": r.get("per_pos"),
            "acceptance_length_by_batch": {k: x["acceptance"]["mean_acceptance_length"] for k, x in b.items()
                                           if "acceptance" in x},
            "num_speculative_tokens": (r["spec"] or {}).get("num_speculative_tokens"),
            "engine_log_facts": engine_log_facts(run.work / "logs" / f"serve-{v}.log"),
            "profile": r.get("profile"),
        }
    ref = res["plain"].get("margins")
    n1 = str(min(run.profile.serve_batches))
    if ref:
        # Each output that differs from plain's batch-1 output, placed where it first diverges. Plain's own
        # larger batches are the control: they diverge only by bf16 batch numerics.
        out["divergence_from_plain_b1"] = {
            v: {k: divergences(x["outputs"], ref) for k, x in r["batches"].items()} for v, r in res.items()}
        out["margin_run_equals_plain_b1"] = (sum(o == q for o, q in zip(ref["outputs"], plain[n1]["outputs"]))
                                             / max(len(ref["outputs"]), 1))
    out["plain_batch_invariance"] = {  # plain's own outputs at batch b vs batch 1 (bf16 batch numerics)
        k: sum(o == q for o, q in zip(x["outputs"], plain[n1]["outputs"])) / max(min(len(x["outputs"]),
                                                                                   len(plain[n1]["outputs"])), 1)
        for k, x in plain.items()}
    return out


# -- stage: report -----------------------------------------------------------------------------------
def summary(run: Run, variants: tuple[str, ...]) -> dict[str, Any]:
    p = run.profile
    tgt, off, srv = run.result("target"), run.result("offline"), run.result("serve")
    if srv is None and (run.work / "serve" / "plain.json").exists():  # partial: the variants so far
        srv = serve_summary(run, variants)
    sv = (srv or {}).get("variants", {})
    keys = [str(b) for b in p.serve_batches]

    def served(v: str) -> dict[str, Any]:
        s = sv.get(v, {})
        return {"acceptance_length": s.get("acceptance_length"), "speedup": s.get("speedup", {}),
                "output_tokens_per_s": s.get("output_tokens_per_s", {}), "speedup_range": s.get("speedup_range", {}),
                "speedup_by_round": s.get("speedup_by_round", {}),
                "outputs_equal_plain": s.get("outputs_equal_plain", {}),
                "tpot_ms_median": s.get("tpot_ms_median", {}), "tpot_ms_p99": s.get("tpot_ms_p99", {}),
                "acceptance_length_by_batch": s.get("acceptance_length_by_batch", {}),
                "per_position": s.get("per_position"), "num_speculative_tokens": s.get("num_speculative_tokens"),
                "model_runner": s.get("model_runner"), "engine_start_s": s.get("engine_start_s")}

    j: dict[str, Any] = {
        "profile": p.name, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": all(run.result(s) is not None for s in STAGES[:-1]),
        "stages_done": [s for s in STAGES[:-1] if run.result(s) is not None], "failures": run.failures,
        "stage_walls_s": {k: v["wall_s"] for k, v in run.state["steps"].items()}, "invocations": run.state["calls"],
        "overrides": run.overrides,
        "device": {"name": gpu_name() or "cpu", "trainer_device": p.device,
                   "vllm": next((x["vllm_version"] for x in sv.values()), None)},
        "batch_sizes": keys, "target": tgt,
        "plain": served("plain"), "ngram": served("ngram"),
        "memory": {"plan": p.memory_plan, "capture_engine": p.engine, "serve_engine": p.serve_engine,
                   "eval_kv_cache_mb": p.eval_kv_mb},
        "serve_settings": {"prompts_per_batch": {str(k): v for k, v in p.serve_prompts.items()},
                           "max_tokens": p.serve_max_tokens, "repeats": p.serve_repeats, "greedy": True},
        "plain_batch_invariance": (srv or {}).get("plain_batch_invariance"),
    }
    for kind in DRAFTERS:
        tr = run.result(kind)
        j[kind] = {**served(kind), "train": tr}
        j["memory"][kind] = (tr or {}).get("memory")
    j["extra_variants"] = [v for v in variants if v not in SERVE_VARIANTS]
    for v in j["extra_variants"]:
        j[v] = served(v)
    j["serve_profiles"] = {v: s["profile"] for v, s in sv.items() if s.get("profile")}
    j["engine_log_facts"] = {v: s.get("engine_log_facts", []) for v, s in sv.items()}
    if srv and srv.get("divergence_from_plain_b1"):
        j["divergence_from_plain_b1"] = {
            v: {k: {x: y for x, y in d.items() if x != "rows"} for k, d in by.items()}
            for v, by in srv["divergence_from_plain_b1"].items()}
        j["margin_run_equals_plain_b1"] = srv["margin_run_equals_plain_b1"]
    e3 = run.result("eagle3")
    if off is not None:
        on_wall = (e3 or {}).get("wall_s")
        span = None
        if e3:
            r = e3["rates"]
            span = round(r["trainer_startup_wait_s"] + r["consumer_wall_s"], 1)
        on_recs = (e3 or {}).get("inputs_trained")
        per_k = lambda x, n: round(1000 * x / n, 1) if x is not None and n else None  # noqa: E731
        j["offline"] = {**{k: v for k, v in off.items() if k != "loss_curve"},
                        "online_wall_s": on_wall, "online_capture_train_span_s": span, "online_disk_bytes": 0,
                        "online_inputs": on_recs,
                        # Per 1000 records, so an offline run on a subset (Profile.offline_records) compares.
                        "offline_total_s_per_1k": per_k(off["total_wall_s"], off["dataset_records"]),
                        "online_span_s_per_1k": per_k(span, on_recs),
                        "offline_dataset_bytes_at_online_size": (round(off["dataset_bytes"] * on_recs / off["dataset_records"])
                                                                 if on_recs and off["dataset_records"] else None),
                        "online_shm_pool_bytes": p.shm_slots * (p.shm_slot_mb << 20),
                        "note": "online wall includes its periodic and final acceptance evaluations and the export; "
                                "the span is first-record wait + consumer time (capture and training overlapped)"}
    e, n = j["eagle3"]["speedup"], j["ngram"]["speedup"]
    j["goals"] = {
        "eagle3_speedup_b1_ge_1.5": (e.get(keys[0]) or 0) >= 1.5 if e else None,
        "eagle3_above_ngram_everywhere": all(e.get(k, 0) > n.get(k, 0) for k in keys) if e and n else None,
        "outputs_equal_plain_all": all(x == 1.0 for v in ("ngram", *DRAFTERS) for x in j[v]["outputs_equal_plain"].values())
        if sv else None,
    }
    return j


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def write_markdown(path: Path, j: dict[str, Any]) -> None:
    keys = j["batch_sizes"]
    L = [f"# layertap drafter loop ({j['profile']}, {j['device']['name']}, vLLM {fmt(j['device']['vllm'])})", "",
         f"Written {j['written']}; complete: {j['complete']}; stages done: {', '.join(j['stages_done']) or 'none'}"
         + (f"; failures: {j['failures']}" if j["failures"] else ""), ""]
    t = j.get("target") or {}
    if t:
        L += ["## Target", "", f"`{t['path']}`: {t['parameters'] / 1e6:.1f} M parameters, {t['dtype']}, "
              f"final training loss {t['final_loss']:.3f} after {t['steps_done']}/{t['steps']} steps"
              + (" (cached)" if t.get("cached") else f" in {fmt(t['train_s'], 0)} s, {fmt(t['train_tokens_per_s'], 0)} "
                 f"tok/s, MFU {fmt(t['train_mfu'])}"), ""]
    L += ["## Serving (greedy, held-out prompts, b requests in flight; output tokens/s after a warm-up)", "",
          "| variant | runner | mean acceptance length | " + " | ".join(f"tok/s b={k}" for k in keys) + " | "
          + " | ".join(f"speed-up b={k}" for k in keys) + " | outputs == plain |",
          "|---|---|---|" + "---|" * (2 * len(keys)) + "---|"]
    for v in ("plain", "ngram", "eagle3", "dflash", *j.get("extra_variants", [])):
        s = j.get(v) or {}
        if not s.get("output_tokens_per_s"):
            L.append(f"| {v} | - | - |" + " - |" * (2 * len(keys)) + " - |")
            continue
        eq = " ".join(f"{k}:{fmt(s['outputs_equal_plain'].get(k), 2)}" for k in keys)
        rng = s.get("speedup_range", {})
        L.append(f"| {v} | {fmt(s['model_runner'])} | {fmt(s['acceptance_length'])} | "
                 + " | ".join(fmt(s["output_tokens_per_s"].get(k), 1) for k in keys) + " | "
                 + " | ".join(f"{fmt(s['speedup'].get(k), 2)}" + (f" ({rng[k][0]:.2f}-{rng[k][1]:.2f})" if k in rng and
                                                                   len(set(rng[k])) > 1 else "") for k in keys)
                 + f" | {eq} |")
    L += ["", "Time per output token of a request (first to last token), median / p99 ms:", "",
          "| variant | " + " | ".join(f"b={k}" for k in keys) + " |", "|---|" + "---|" * len(keys)]
    for v in ("plain", "ngram", "eagle3", "dflash", *j.get("extra_variants", [])):
        s = j.get(v) or {}
        med, p99 = s.get("tpot_ms_median") or {}, s.get("tpot_ms_p99") or {}
        if med:
            L.append(f"| {v} | " + " | ".join(f"{fmt(med.get(k), 2)} / {fmt(p99.get(k), 2)}" for k in keys) + " |")
    profs = j.get("serve_profiles") or {}
    if profs:
        L += ["", f"Where batch-{keys[0]} decode time goes (torch profiler, the engine's worker process, a few "
              "prompts after the timed rounds; per output token; the profiler inflates CPU time):", "",
              "| variant | AL | window ms | GPU busy | GPU busy ms | kernels | busiest CPU thread ms | top CPU ops (ms) |",
              "|---|---|---|---|---|---|---|---|"]
        for v, pr in profs.items():
            sm = pr["summary"]
            thr = max((sm.get("cpu_threads_busy_ms_per_request") or {0: None}).values(), default=None)
            ops = ", ".join(f"{k[:40]} {x:.3f}" for k, x in list((sm.get("top_cpu_ops_ms_per_request") or {}).items())[:3])
            L.append(f"| {v} | {fmt(pr.get('acceptance_length'), 2)} | {fmt(sm.get('window_ms_per_request'))} | "
                     f"{fmt(sm.get('gpu_busy_fraction'), 2)} | "
                     f"{fmt(sum((sm.get('gpu_busy_ms_per_request_by_stream') or {}).values()))} | "
                     f"{fmt(sm.get('kernels_per_request'), 1)} | {fmt(thr)} | {ops} |")
    div = j.get("divergence_from_plain_b1")
    if div:
        L += ["", f"Outputs that differ from plain's batch-{keys[0]} output, placed where they first diverge: "
              "diverged / compared, and plain's top-1 - top-2 logprob margin there (max, median); 'runner-up' is "
              "the share that took plain's second choice. Plain's own larger batches are the control (bf16 "
              f"batch numerics). The margin run reproduced plain's batch-{keys[0]} outputs: "
              f"{fmt(j.get('margin_run_equals_plain_b1'), 2)}.", "",
              "| variant | " + " | ".join(f"b={k}" for k in keys) + " |", "|---|" + "---|" * len(keys)]
        for v, by in div.items():
            L.append(f"| {v} | " + " | ".join(
                f"{d['diverged']}/{d['compared']}" + (f", max {fmt(d['max_margin'], 3)}, med {fmt(d['median_margin'], 3)}, "
                                                      f"runner-up {fmt(d['runner_up_share'], 2)}" if d["diverged"] else "")
                if (d := by.get(k)) else "-" for k in keys) + " |")
    L += ["", f"Goals: {j['goals']}", f"Plain's own outputs at batch b equal to batch {keys[0]}: "
          f"{j.get('plain_batch_invariance')}", "", "## Online training (`layertap train`, engine and trainer on one "
          "device, records over shm)", "",
          "| drafter | wall s | steps | final loss | AL (training eval) | ngram AL | trainer idle | trainer tok/s | "
          "busy tok/s | MFU | records/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k in DRAFTERS:
        r = (j.get(k) or {}).get("train")
        if r:
            note = f" ({r['rates_note']})" if r.get("rates_note") else ""
            L.append(f"| {k}{note} | {r['wall_s']} | "
                     f"{r['steps']} | {fmt(r['final_loss'], 4)} | "
                     f"{fmt(r['train_eval_acceptance_length'])} | {fmt(r['train_eval_ngram_acceptance_length'])} | "
                     f"{fmt(r['trainer_idle_fraction'])} | {fmt(r['trainer_tokens_per_s'], 0)} | "
                     f"{fmt(r['trainer_busy_tokens_per_s'], 0)} | {fmt(r['mfu'], 4)} | {fmt(r['records_per_s'], 1)} |")
    o = j.get("offline")
    if o:
        same = o.get("online_inputs") in (None, o["dataset_records"])
        L += ["", "## Offline vs online (EAGLE-3, same recipe" + (", inputs and steps)" if same else
              f"; offline on the first {o['dataset_records']} of the online run's {o['online_inputs']} inputs)"), "",
              "| | wall s | disk bytes |", "|---|---|---|",
              f"| offline capture | {o['capture_wall_s']} | {o['dataset_bytes']:,} ({o['dataset_records']} records) |",
              f"| offline train-offline | {o['train_wall_s']} | |", f"| offline total | {o['total_wall_s']} | |",
              f"| online (layertap train, incl. evaluations) | {fmt(o['online_wall_s'], 1)} | 0 (shm pool "
              f"{o['online_shm_pool_bytes']:,} in RAM) |",
              f"| online capture + train span | {fmt(o['online_capture_train_span_s'], 1)} | |", "",
              f"Per 1000 records: offline {fmt(o.get('offline_total_s_per_1k'), 1)} s (capture + train-offline), "
              f"online {fmt(o.get('online_span_s_per_1k'), 1)} s (capture and training overlapped)."
              + ("" if same or not o.get("offline_dataset_bytes_at_online_size") else
                 f" At the online run's size the offline dataset would hold "
                 f"{o['offline_dataset_bytes_at_online_size'] / 2**30:.1f} GiB."), "", o["note"]]
    L += ["", "## Memory", "", j["memory"]["plan"], ""]
    for k in DRAFTERS:
        m = j["memory"].get(k)
        if m:
            L.append(f"- {k}: device peak {m['device_peak_used_mib']} of {m['device_total_mib']} MiB; per process: "
                     + "; ".join(f"{v.get('role')}: {v.get('peak_mib')} MiB" for v in m["processes"].values()))
    L += ["", "![loop](gpu_loop.png)", ""]
    path.write_text("\n".join(L))


def write_png(path: Path, j: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = j["batch_sizes"]
    color = {"plain": "tab:gray", "ngram": "tab:blue", "eagle3": "tab:orange", "dflash": "tab:green"}
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    t = j.get("target") or {}
    if t.get("losses"):
        ax[0, 0].plot(range(1, len(t["losses"]) + 1), t["losses"])
    elif t:
        ax[0, 0].text(0.5, 0.5, f"cached target: final loss {t['final_loss']:.3f}\n(no curve recorded)",
                      ha="center", va="center", transform=ax[0, 0].transAxes)
    ax[0, 0].set_title(f"target training loss ({t.get('dtype', '-')})"), ax[0, 0].set_xlabel("step")
    for k in DRAFTERS:
        r = (j.get(k) or {}).get("train")
        if r and r["loss_curve"]:
            ax[0, 1].plot(*zip(*r["loss_curve"]), color=color[k], label=f"{k} online")
    if j.get("offline") and (j["offline"].get("steps") or 0) > 0:
        off = read_json(Path(j["offline"]["dataset_dir"]).parent / "train" / "history.json") or []
        if off:
            ax[0, 1].plot([m["step"] for m in off], [m["loss"] for m in off], "--", color=color["eagle3"],
                          label="eagle3 offline")
    ax[0, 1].set_yscale("log"), ax[0, 1].set_title("drafter training loss"), ax[0, 1].set_xlabel("step")
    ax[0, 1].legend(fontsize=8)
    for k in DRAFTERS:
        r = (j.get(k) or {}).get("train")
        if r and r["acceptance_curve"]:
            ax[0, 2].plot(*zip(*r["acceptance_curve"]), "o-", color=color[k], label=k)
            if r.get("train_eval_ngram_acceptance_length"):
                ax[0, 2].axhline(r["train_eval_ngram_acceptance_length"], color=color["ngram"], ls="--", lw=0.8)
    ax[0, 2].set_title("acceptance length in vLLM vs step (dashed: ngram)"), ax[0, 2].set_xlabel("step")
    ax[0, 2].legend(fontsize=8)
    xs = range(len(keys))
    width = 0.2
    for i, v in enumerate(("plain", "ngram", "eagle3", "dflash")):
        s = j.get(v) or {}
        ys = [s.get("output_tokens_per_s", {}).get(k, 0) for k in keys]
        ax[1, 0].bar([x + (i - 1.5) * width for x in xs], ys, width, color=color[v], label=v)
        if v != "plain":
            sp = [s.get("speedup", {}).get(k, 0) for k in keys]
            ax[1, 1].bar([x + (i - 2) * width for x in xs], sp, width, color=color[v], label=v)
            ax[1, 2].bar(i - 1, s.get("acceptance_length") or 0, 0.6, color=color[v], label=v)
    for a, title in ((ax[1, 0], "output tokens/s"), (ax[1, 1], "speed-up over plain vLLM")):
        a.set_xticks(list(xs)), a.set_xticklabels([f"batch {k}" for k in keys]), a.set_title(title), a.legend(fontsize=8)
    ax[1, 1].axhline(1.0, color="black", lw=0.8), ax[1, 1].axhline(1.5, color="red", ls=":", lw=0.8)
    ax[1, 2].set_xticks([0, 1, 2]), ax[1, 2].set_xticklabels(["ngram", "eagle3", "dflash"])
    ax[1, 2].set_title("served mean acceptance length (vLLM counters)")
    fig.suptitle(f"layertap drafter loop: {j['profile']} on {j['device']['name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_outputs(run: Run, variants: tuple[str, ...], *, full: bool, results_dir: Path | None) -> dict[str, Any]:
    j = summary(run, variants)
    rep = run.work / "report"
    write_json(rep / "gpu_loop.json", j)
    names = ["gpu_loop.json"]
    if full:
        write_markdown(rep / "gpu_loop.md", j)
        write_png(rep / "gpu_loop.png", j)
        names += ["gpu_loop.md", "gpu_loop.png"]
    for dest in filter(None, (run.out, results_dir)):
        dest.mkdir(parents=True, exist_ok=True)
        for n in names:
            shutil.copy2(rep / n, dest / n)
    shutil.copy2(run.work / "gpu_loop.log", run.out / "gpu_loop.log")
    if full:
        pack_logs(run.work, run.out / "gpu_loop_logs.tar.gz")
    return j


def pack_logs(work: Path, dest: Path, tail_bytes: int = 2 << 20) -> None:
    """Every stage log (its last 2 MiB), the runs' own reports and state.json in one archive: the device
    tool brings back few files, and a failure on the GPU must be readable here."""
    import io
    import tarfile

    files = [*sorted((work / "logs").glob("*.log")), work / "state.json",
             *[work / k / n for k in DRAFTERS for n in ("report.md", "report.json")],
             *sorted((work / "serve").glob("*.failed")), *sorted(work.glob("*/evals/eval-*.log"))]
    with tarfile.open(dest, "w:gz") as tar:
        for f in files:
            if not f.is_file():
                continue
            data = f.read_bytes()[-tail_bytes:]
            info = tarfile.TarInfo(str(f.relative_to(work)))
            info.size, info.mtime = len(data), int(f.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))


# -- driver ------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), required=True, help="sizes of every stage")
    ap.add_argument("--work", required=True, type=Path, help="work directory (kept between calls: resume)")
    ap.add_argument("--out", required=True, type=Path, help="where gpu_loop.json/.md/.png and the log are copied")
    ap.add_argument("--stages", default="all", help=f"comma list of {','.join(STAGES)} (default all)")
    ap.add_argument("--deadline-s", type=float, default=None, help="end this invocation within N s (resume later)")
    ap.add_argument("--serve-variants", default=None,
                    help=f"serving variants (default: the profile's; {', '.join(SERVE_VARIANTS)} and also "
                         f"{', '.join(OPTIONAL_VARIANTS)}, eagle3-kN, dflash-kN)")
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="also copy the report here (e.g. benchmarks/results/DATE)")
    ap.add_argument("--retry-failed", action="store_true",
                    help="run stages again that failed in an earlier call (default: leave them failed)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="change a profile value, e.g. steps=300, target.steps=300, target.model.num_layers=20")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_worker"]:
        return {"target": worker_target, "serve": worker_serve}[argv[1]](*argv[2:])
    a = parse(argv)
    stages = STAGES if a.stages == "all" else tuple(s.strip() for s in a.stages.split(","))
    profile = apply_overrides(PROFILES[a.profile], a.override)
    variants = (tuple(v.strip() for v in a.serve_variants.split(",")) if a.serve_variants
                else profile.serve_variants)
    bad = [s for s in stages if s not in STAGES] + [v for v in variants if not known_variant(v)]
    if bad:
        raise SystemExit(f"unknown stage or variant: {', '.join(bad)}")
    run = Run(profile, a.work.resolve(), a.out.resolve(), a.deadline_s, list(a.override))
    if profile.device == "cuda" and gpu_name() is None:
        raise SystemExit(f"profile {profile.name} needs a CUDA GPU (nvidia-smi finds none)")
    run.log(f"profile {profile.name}, work {run.work}, stages {','.join(stages)}, deadline {a.deadline_s}")
    failed = later = False
    steps: list[tuple[str, Callable[[], None]]] = [
        ("target", lambda: stage_target(run)), ("eagle3", lambda: stage_online(run, "eagle3")),
        ("dflash", lambda: stage_online(run, "dflash")), ("serve", lambda: stage_serve(run, variants)),
        ("offline", lambda: stage_offline(run))]
    if any(variant_drafter(v) == "offline" for v in variants):  # serving the offline drafter: offline first
        steps[3], steps[4] = steps[4], steps[3]
    seen: dict[str, bool] = {}

    def pending(name: str) -> bool:
        """Whether ``name`` is to run in this call (asked once per stage: the skip is logged once)."""
        if name in seen:
            return seen[name]
        seen[name] = False
        if name not in stages:
            return False
        if run.result(name) is not None:
            run.log(f"{name}: done earlier, skipped")
            return False
        if run.state["steps"].get(name, {}).get("status") == "failed" and not a.retry_failed:
            run.log(f"{name}: FAILED in an earlier call, not retried (--retry-failed): {run.failures[name]}")
            return False
        seen[name] = True
        return True

    def attempt(name: str, fn: Callable[[], None]) -> str:
        """One stage, logged and marked; its outcome: done | deferred | deadline | failed."""
        t0 = time.monotonic()
        try:
            if name != "target" and run.result("target") is None:
                raise Deferred("waits for the target stage")
            if name != "serve":  # serve checks the time per variant
                run.need(name, profile.estimates[name])
            run.log(f"{name}: start")
            fn()
            run.log(f"{name}: done in {time.monotonic() - t0:.0f}s")
            run.mark(name, "done", time.monotonic() - t0)
            return "done"
        except Deferred as e:
            run.log(f"{name}: deferred: {e} (a later call runs it)")
            run.mark(name, "deferred", time.monotonic() - t0, str(e))
            return "deferred"
        except DeadlineReached as e:
            run.log(f"deadline: {e}; stopping here (run the same command again to resume)")
            run.mark(name, "deadline", time.monotonic() - t0, str(e))
            return "deadline"
        except StageFailed as e:
            run.mark(name, "failed", time.monotonic() - t0, str(e))
            run.log(f"{name}: FAILED: {e}")
            return "failed"
        except Exception as e:  # a bug here must not cost the device call: log it, go on with the rest
            run.mark(name, "failed", time.monotonic() - t0, f"{type(e).__name__}: {e}")
            run.log(f"{name}: FAILED with an unexpected error:\n{traceback.format_exc()}")
            return "failed"

    together = set(DRAFTERS) if profile.parallel_drafters else set()
    attempted: set[str] = set()
    for name, fn in steps:
        if name in attempted or not pending(name):
            continue
        group = [(name, fn)] + [(n, f) for n, f in steps
                                if name in together and n in together and n != name and pending(n)]
        attempted.update(n for n, _ in group)
        if len(group) == 1:
            outcomes = [attempt(name, fn)]
        else:  # the drafter stages at once (Profile.parallel_drafters), each in a thread of its own
            try:
                if run.result("target") is not None:
                    ensure_data(run, target_path(run))  # written once, here, not by two threads at once
            except Exception as e:  # each stage meets it again and fails by name
                run.log(f"data for the drafter stages: {type(e).__name__}: {e}")
            run.log(f"{' and '.join(n for n, _ in group)}: at once (parallel_drafters)")
            with ThreadPoolExecutor(len(group), thread_name_prefix="stage") as pool:
                outcomes = list(pool.map(lambda nf: attempt(*nf), group))
        failed = failed or "failed" in outcomes
        later = later or any(o in ("deferred", "deadline") for o in outcomes)
        try:
            write_outputs(run, variants, full=False, results_dir=None)  # partial results after every stage
        except Exception:
            run.log(f"partial report FAILED:\n{traceback.format_exc()}")
        if "deadline" in outcomes:
            break
    if "report" in stages:
        try:
            j = write_outputs(run, variants, full=True, results_dir=a.results_dir)
        except Exception:
            run.log(f"report FAILED (the results are in {run.work / 'results'}):\n{traceback.format_exc()}")
            return 1
        run.log(f"report: {run.out / 'gpu_loop.md'} (complete: {j['complete']})")
        for v in ("ngram", "eagle3", "dflash"):
            s = j[v]
            run.log(f"  {v:>7}: AL {fmt(s['acceptance_length'])}  speed-up "
                    + " ".join(f"b{k}={fmt(x, 2)}" for k, x in s["speedup"].items())
                    + "  equal " + " ".join(f"b{k}={fmt(x, 2)}" for k, x in s["outputs_equal_plain"].items()))
    # 75 while work that can run remains (call again); then 1 if a stage failed, else 0.
    return EXIT_DEADLINE if later else 1 if failed or run.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
