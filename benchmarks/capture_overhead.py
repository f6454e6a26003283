"""Capture overhead: the same prefill workload through plain vLLM, through vLLM with layertap capture, and
through an HF transformers second pass (what users do without layertap). One process, one run.

Prints tokens/s of each and the ratios, per in-flight batch size. By default all variants' engines are
alive at once and measured in interleaved rounds (``--repeats``), so a ratio compares runs minutes apart
at most, on the same machine state; ``--separate`` runs one variant after the other instead. Records must be complete when the
capture call returns: they are counted (and each one's token digest proven by the Tap). A second table gives
the driving process's view of every variant (``Timeline``: occupancy, request latency, requests per engine
output), which tells an engine-side gap from a driver-side one.

Variants (``--variants``; the ratio column is ``capture`` over ``plain``, the others explain the gap; dropped
once they explain nothing more, with where their answer stands: ``floor-hashed``, vLLM's block hashes kept,
0.94 of the floor's throughput at 256 in flight, RESULTS 2026-12-04 evening; the skip is the default and warns
by name at start-up where it did not take; ``capture-torch``, the torch record path, measured against the lean one on
2026-12-03/04; ``capture-early``, records taken off the pool also while their requests run, and ``capture-pollall``
(the way before and after the Tap of 6ff1a5f, one record at a time, which it was paired against and which was backed
out), within the noise on 2026-12-06 (RESULTS, sixth session); ``capture-chunked``, each record's copy in 1 MiB
pieces (connector option offload_copy_chunk_kb), as capture on 2026-12-07 (H100, six rounds: 0.97 / 0.89 / 0.96
against 0.98 / 0.90 / 0.96 at 1 / 4 / 16 in flight; an 8-byte copy waited 264 us behind another process's pieces,
234 behind its whole copies: d2h_bandwidth.py);
``capture-piecewise``, PIECEWISE graphs, which prefill runs either way: ``serve_overhead.py`` keeps it):
    plain              vLLM as users run it (its default scheduling; the engine core forked from the driver)
    plain-spawn        plain with its engine core spawned, as every capture engine's is (``launch.engine_env``).
                       The same work as plain, so plain-spawn / plain is an A/A control: how far two engines
                       drift apart on the host with no change of work (H100, 2026-12-05: 0.89-1.23 across
                       rounds at 1-4 in flight; spawning itself cost nothing: medians 1.04-1.16)
    plain-ahead        with --queue only: plain with twice the in-flight target in the engine (the target running,
                       as many waiting), as the Tap keeps it (``Tap.lookahead``), where plain submits every prompt
                       of a call at once (H100, 2026-12-07, max_num_seqs 4: capture, 8 requests in the engine, ran
                       0.77-1.32 of plain's pace with 32 queued; whether the queue's depth moves vLLM's pace is
                       what plain-ahead / plain says)
    plain-wide         with --queue only: plain in an engine of --wide-seqs seats, the driver keeping the in-flight
                       target in it (the regime without --queue, at the same sizes): plain / plain-wide says
                       whether an engine whose max_num_seqs is the target, with the rest of the call queued, runs
                       faster or slower than a wide one the driver feeds (H100, 2026-12-07: plain queued at
                       max_num_seqs 1 ran 66k tok/s, driver-fed at max_num_seqs 4 84k, in two steps of one lease)
    plain-sync         plain with vLLM's synchronous scheduling (async_scheduling=False); see capture-sync
    floor              the hook capture engine + the layertap connector, reading no rows (the cost of the
                       model writing its rows into the capture layer)
    floor-gather       floor, plus each record's rows gathered on the device as ``capture`` gathers them (the
                       forward stream waits for the gather), then dropped: no transport memory, host copy or
                       record; between floor and capture-raw it splits the record path into the gather and
                       the rest (reservations, host copies, commits, the consumer)
    capture            layertap capture (default: hook path, vLLM's default scheduling, records written in
                       place in the shm pool and committed on the device: a commit word copied after each
                       payload, no engine thread waits for the copies)
    capture-inproc     capture with the step thread reserving, copying and committing each record itself (connector
                       option offload=False), as before the record process (engine/record_proc.py): capture /
                       capture-inproc is what moving that work off the engine's thread buys
    capture-nocopy     capture with the record process copying no rows (connector option offload_rows="skip"; its
                       stream still waits on each gather's event, it reserves and commits): records carry no rows.
                       capture / capture-nocopy is what the rows' device-to-host copies cost the engine
    capture-nogpu      as capture-nocopy, and the record process makes no CUDA call at all (offload_rows="nogpu"):
                       capture-nocopy / capture-nogpu is what a second CUDA context waiting on the engine's events
                       costs; capture-nogpu / floor-gather the record process's CPU work and the hand-over
    capture-loud       capture with every step that runs no forward going through vLLM's connector round
                       (connector option quiet_empty_steps=False): capture / capture-loud is what skipping the
                       empty rounds buys (compat.install_quiet_empty_steps)
    capture-raw        the capture engine and transport of ``capture``, driven like plain (no Tap loop, no
                       proof; a thread takes the records off the transport): capture / capture-raw is the
                       Tap's share of the gap, capture-raw / plain the engine's and the record path's
    capture-after      capture-raw with no record work in the driving process while the clock runs: records wait in
                       the pool until the call's requests finished (needs --chunk). Beside floor, the engine's
                       record path alone; capture / capture-after, the driving process's record work
    capture-wide       with --queue only: capture where the engine has --wide-seqs seats, as a caller who gives
                       max_num_seqs gets it: the Tap keeps max_inflight in the engine, none waiting (no lookahead)
    capture-sync       capture with vLLM's synchronous scheduling (async_scheduling=False): beside plain-sync
                       (plain, the same), whether the engine's one-step-ahead scheduling is what sets capture's
                       requests into alternating half batches at 1-4 in flight (trace summaries: step_sizes)
    capture-extract    capture through extract_hidden_states (synchronous scheduling on vLLM 0.25/CUDA)

``--profile-dir DIR``: after the rounds, each engine is profiled with torch's profiler (CPU + CUDA
activities, vLLM's ``profiler_config``) over a few requests at each ``--profile-inflight`` target; the
traces and their summaries (``trace_summary.py``) land in DIR, and a side-by-side table is printed.

    python benchmarks/capture_overhead.py                       # CPU: tiny model, small workload
    python benchmarks/capture_overhead.py --hidden 2048 --num-layers 16 --prompts 256 --prompt-len 1024 \
        --batch-sizes 1,4,16,64 --dtype bfloat16                # GPU (see scripts/gpu_check.sh)
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trace_summary


def build_model(args) -> Path:
    from layertap.models.tiny import TinySpec, build_tiny_model, default_cache_dir, spec_hash

    heads = max(1, args.hidden // args.head_dim)
    spec = TinySpec(kind="qwen3", hidden_size=args.hidden, num_layers=args.num_layers, num_heads=heads,
                    num_kv_heads=max(1, heads // 4) if heads >= 4 else heads, head_dim=args.head_dim,
                    intermediate_size=args.hidden * 3, vocab_size=args.vocab, max_position_embeddings=8192)
    if getattr(args, "gpu_build", False):  # random weights made on the GPU, saved in the run's dtype
        return build_tiny_model(default_cache_dir() / f"bench-{spec_hash(spec)}-cuda-{args.dtype}", spec,
                                device="cuda", save_dtype=args.dtype)
    return build_tiny_model(default_cache_dir() / f"bench-{spec_hash(spec)}", spec)


def cpu_list(text: str) -> list[int]:
    """CPU ids from a Linux cpulist (``0-7,16-23``)."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("-")
        if not a.isdigit() or (b and not b.isdigit()):
            raise ValueError(f"bad CPU list {text!r}: expected ids and ranges such as 0-7,16")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def numa_nodes(root: str = "/sys/devices/system/node") -> dict[int, list[int]]:
    """The CPUs of each NUMA node of this host, from sysfs ({} where it has no node directories)."""
    nodes = {}
    for d in sorted(Path(root).glob("node[0-9]*")):
        f = d / "cpulist"
        if f.exists():
            nodes[int(d.name[4:])] = cpu_list(f.read_text())
    return nodes


def resolve_cpus(spec: str, root: str = "/sys/devices/system/node") -> list[int]:
    """``--cpus``: ``node:N`` (the CPUs of NUMA node N) or a cpulist (``0-7,16``)."""
    if spec.startswith("node:"):
        nodes = numa_nodes(root)
        n = spec[5:]
        if not n.isdigit() or int(n) not in nodes:
            raise SystemExit(f"--cpus {spec}: this host's NUMA nodes are {sorted(nodes) or 'not listed in ' + root}")
        return nodes[int(n)]
    try:
        return cpu_list(spec)
    except ValueError as e:
        raise SystemExit(f"--cpus: {e}") from None


def host_line() -> str:
    """The host's NUMA layout and the CPUs this process may run on (engines inherit them)."""
    nodes = numa_nodes()
    where = "; ".join(f"node {k}: {len(v)} CPUs ({v[0]}-{v[-1]})" for k, v in nodes.items()) or "no NUMA nodes listed"
    return f"host: {os.cpu_count()} CPUs, {where}; this run may use {len(os.sched_getaffinity(0))} CPUs"


def prompts(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, args.vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.prompts)]


def submit_limit(runner, inflight: int, data) -> int:
    """How many requests ``drive`` keeps in the engine: the in-flight target, or with ``--queue`` every prompt
    of the call at once (the engine's ``max_num_seqs``, set to the target, bounds what runs), or for
    ``plain-ahead`` twice the target (the Tap's ``lookahead``)."""
    if not runner.queue:
        return inflight
    return min(len(data), 2 * inflight) if getattr(runner, "ahead", False) else len(data)


def drive(engine, batch: list[list[int]], inflight: int, params_for) -> int:
    """Run every prompt with at most ``inflight`` requests in the engine; returns tokens processed."""
    from vllm import TokensPrompt

    todo = list(enumerate(batch))[::-1]
    running, tokens = 0, 0
    while todo or running:
        while todo and running < inflight:
            i, ids = todo.pop()
            engine.add_request(f"plain-{time.monotonic_ns()}-{i}", TokensPrompt(prompt_token_ids=ids), params_for(i))
            running += 1
            tokens += len(ids)
        for out in engine.step():
            running -= out.finished
    return tokens


def where(frame) -> str:
    """What the driving thread was doing when an engine output arrived (sampled from the receiving thread):
    its innermost frame, and the innermost frame of layertap's Tap or of this benchmark's driving code, the
    line that tells the phase (admission, records, the caller's loop)."""
    inner, outer = None, None
    f, depth = frame, 0
    while f is not None and depth < 60:
        code = f.f_code
        name = os.path.basename(code.co_filename)
        if inner is None:
            inner = f"{name}:{code.co_name}"
        if outer is None and (name == "capture_overhead.py" or code.co_filename.endswith("layertap/tap.py")):
            outer = f"{name}:{f.f_lineno} {code.co_name}"
        f, depth = f.f_back, depth + 1
    return f"{outer or '?'} | {inner or '?'}"


class Timeline:
    """Where a request's time goes, seen from the driving process: wraps one ``LLMEngine``'s ``add_request``
    and ``step`` (a few clock reads per call, the same for every variant). Per ``rate`` call it reports

    - occupancy: time-averaged requests in the engine over the in-flight target (below 1: the driver left
      the engine underfed between a finish and the next admission); summed over the segments a round is
      measured in (``segment()``: with ``--chunk`` other engines run between them);
    - latency: median time from ``add_request`` to the ``step`` call that returned the request finished
      (the engine's time for one request, plus its output's way back);
    - per output: median requests finishing per ``step`` call that finished any (how batched steps were);
    - turnaround: median time from a ``step`` call that returned a finished request to the driver's next
      ``add_request`` (the driver's own share of a request at 1 in flight);
    - with ``--stats`` (vLLM's per-request stats on, in every engine alike), the request's time split at the
      engine core's own timestamps (one clock: CLOCK_MONOTONIC, shared by the processes of one machine):
      ``in`` add_request -> queued in the engine core, ``wait`` queued -> first scheduled, ``run`` scheduled
      -> the engine core's output carrying its last token, ``out`` that output -> the driver's ``step``
      returns it. Which of them grows says where a variant's extra time per request is spent.
    - ``out`` split in three where the engine core runs in its own process (vLLM's ``SyncMPClient``): ``send``
      the output's way to the driving process (the engine core's output thread, the socket, the driver's
      receiving thread), ``late`` how long it then waited in the driver's queue before ``step`` asked for it
      (the driver was busy elsewhere: its record work, the caller; a mean, the others are medians), ``proc``
      vLLM's output processing until ``step`` returns. A grown ``send`` is the engine process's doing (e.g.
      its threads holding the GIL) or the driver's receiving thread's; a grown ``late`` is the driver's."""

    PHASES = ("in", "wait", "run", "out", "send", "late", "proc")

    def __init__(self, engine, late_by: bool = False):
        self.added: dict[str, float] = {}
        self.reset()
        add, step = engine.add_request, engine.step
        self.last_get: tuple[float, float] | None = None  # (driver asked, output arrived) of the last get_output
        self._watch_output_queue(engine, late_by)

        def add_request(request_id, *a, **k):
            t = time.monotonic()
            self.added[request_id] = t
            self.events.append((t, 1))
            if self.last_done is not None:
                self.turnaround.append(t - self.last_done)
                self.last_done = None
            return add(request_id, *a, **k)

        def step_():
            outs = step()
            t = time.monotonic()
            n = 0
            for out in outs:
                if out.finished:
                    n += 1
                    t0 = self.added.pop(out.request_id, None)
                    if t0 is not None:
                        self.latencies.append(t - t0)
                        self.events.append((t, -1))
                        self._phases(out, t0, t)
            if n:
                self.per_output.append(n)
                self.last_done = t
            return outs

        engine.add_request, engine.step = add_request, step_

    def _watch_output_queue(self, engine, late_by: bool) -> None:
        """Stamp each engine-core output when the driver's receiving thread queues it
        (``compat.engine_output_queue``), and when ``step`` asks for it (the client's ``get_output``). An
        in-process engine core has no queue: no split then. ``late_by`` (``--stats``): the receiving thread
        also samples what the driving thread is doing (``where``), and the wait is charged to it."""
        from layertap.engine import compat

        q = compat.engine_output_queue(engine)
        if q is None:
            return
        core = engine.engine_core
        get = core.get_output
        arrivals: collections.deque[tuple[float, str]] = collections.deque()
        put = q.put_nowait
        driver = threading.get_ident()  # the thread that drives the engine (this one)

        def put_nowait(item):  # the receiving thread's only way into the queue (looked up on each call)
            arrivals.append((time.monotonic(), where(sys._current_frames().get(driver)) if late_by else ""))
            put(item)

        def get_output():
            t_call = time.monotonic()
            outs = get()
            arrived, busy = arrivals.popleft() if arrivals else (t_call, "")
            self.last_get = (t_call, arrived)
            if late_by and t_call > arrived:  # the driver was busy when the output came: charge each finished request
                finished = sum(bool(getattr(o, "finished", False)) for o in getattr(outs, "outputs", ()))
                if finished:  # the requests the ``late`` phase counts
                    self.late_by[busy] += (t_call - arrived) * finished
            return outs

        q.put_nowait, core.get_output = put_nowait, get_output

    def _phases(self, out, t_add: float, t_done: float) -> None:
        m = getattr(out, "metrics", None)
        q, s, f = (getattr(m, k, 0.0) or 0.0 for k in ("queued_ts", "scheduled_ts", "last_token_ts"))
        if q and s and f:  # stats on: engine-core timestamps of this request
            vals = [q - t_add, s - q, f - s, t_done - f]
            if self.last_get is not None:
                asked, arrived = self.last_get
                vals += [arrived - f, max(0.0, asked - arrived), t_done - max(asked, arrived)]
            for k, v in zip(self.PHASES, vals):
                self.phases[k].append(v)

    def reset(self) -> None:
        self.added.clear()
        self.events: list[tuple[float, int]] = []  # (time, +1 admitted / -1 finished), this segment
        self.segments: list[list[tuple[float, int]]] = []
        self.latencies: list[float] = []
        self.per_output: list[int] = []
        self.turnaround: list[float] = []
        self.last_done: float | None = None
        self.phases: dict[str, list[float]] = {k: [] for k in self.PHASES}
        self.calls: list[tuple[float, float, float]] = []  # per measured call: (head, tail, its whole time)
        self.late_by: collections.Counter[str] = collections.Counter()  # late seconds by the driver's code then

    def segment(self, call: tuple[float, float] | None = None) -> None:
        """Close the events measured so far as one segment (the engine idles until the next one starts).
        ``call``: (start, end) of the ``rate`` call that made them (time.monotonic), so its time outside the
        requests is kept: from its start to the first ``add_request`` (head) and from the last finished
        request to its return (tail; for capture, the last records' landing and proof)."""
        if self.events:
            self.segments.append(self.events)
            if call is not None:
                first, last = min(t for t, _ in self.events), max(t for t, _ in self.events)
                self.calls.append((first - call[0], call[1] - last, call[1] - call[0]))
        self.events = []
        self.last_done = None  # a turnaround spans no other engine's run

    def summary(self, inflight: int) -> dict[str, float]:
        self.segment()
        area = span = 0.0
        for ev in self.segments:
            ev = sorted(ev)
            level = 0
            for (t, d), (t_next, _) in zip(ev, ev[1:]):
                level += d
                area += level * (t_next - t)
            if len(ev) > 1:
                span += ev[-1][0] - ev[0][0]
        if not span or not self.latencies:
            return {}
        out = {"occupancy": area / span / inflight,
               "latency_ms": 1e3 * statistics.median(self.latencies),
               "latency_mean_ms": 1e3 * statistics.fmean(self.latencies),  # a median hides stalls; the mean does not
               "latency_p90_ms": 1e3 * sorted(self.latencies)[int(0.9 * (len(self.latencies) - 1))],
               "per_output": statistics.median(self.per_output)}
        if self.turnaround:
            out["turnaround_ms"] = 1e3 * statistics.median(self.turnaround)
        if self.calls:  # the calls' time outside any request's span: a share of all their time, and per call
            heads, tails, whole = zip(*self.calls)
            out["outside"] = (sum(heads) + sum(tails)) / sum(whole)
            out["head_ms"], out["tail_ms"] = 1e3 * statistics.fmean(heads), 1e3 * statistics.fmean(tails)
        if self.late_by:  # late ms a request, by what the driver was doing when the output arrived
            out["late_by"] = {k: 1e3 * v / len(self.latencies) for k, v in self.late_by.most_common(6)}
        for k, v in self.phases.items():
            if v:  # late: a mean (most outputs wait not at all; a median would hide the ones that do)
                out[f"{k}_ms"] = 1e3 * (statistics.fmean(v) if k == "late" else statistics.median(v))
        return out


def chunks_of(data: list, inflight: int, chunk: int | None) -> list[list]:
    """``data`` cut into the pieces one round measures each engine on in turn (``--chunk``: at least
    ``chunk`` and 4 x ``inflight`` prompts each, a short tail joined to the piece before it); the whole of
    it without ``--chunk``."""
    if not chunk:
        return [data]
    size = max(chunk, 4 * inflight)
    parts = [data[i:i + size] for i in range(0, len(data), size)]
    if len(parts) > 1 and len(parts[-1]) < size:
        parts[-2:] = [parts[-2] + parts[-1]]
    return parts


def engine_kwargs(args, wide: bool = False) -> dict:
    """The engine's arguments, the same for every variant; ``wide``: ``--wide-seqs`` seats (the -wide variants)."""
    seqs = args.wide_seqs if wide else max(args.batch_sizes)
    kw = dict(dtype=args.dtype, max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=seqs,
              max_num_batched_tokens=max(args.max_num_batched_tokens, args.prompt_len),
              enable_prefix_caching=False, enforce_eager=args.eager)
    if getattr(args, "stats", False):
        kw["disable_log_stats"] = False  # RequestOutput.metrics: the engine core's timestamps (Timeline)
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    if torch.cuda.is_available():
        kw["gpu_memory_utilization"] = args.gpu_mem
    else:
        kw["kv_cache_memory_bytes"] = 512 << 20
    return kw


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def needs_queue(args, variant: str) -> None:
    """plain-ahead and the -wide variants compare regimes that only --queue sets apart: refuse them without it."""
    if not args.queue:
        raise SystemExit(f"{variant} needs --queue (without it every engine's max_num_seqs is the largest batch size "
                         "and the driver keeps the target in it: plain and capture are that regime)")


def record_mode(args) -> str:
    """The records' mode: ``prompt`` for ``--max-tokens 1`` (prefill only), else ``generate``."""
    return "prompt" if args.max_tokens == 1 else "generate"


def gen_params(args):
    """Greedy, ``--max-tokens`` new tokens each (no early stop), no detokenizing: the same for every variant."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


class Plain:
    """vLLM as users run it, driven request by request through ``LLMEngine``."""

    def __init__(self, model, data, args, spawn: bool = False, ahead: bool = False, wide: bool = False, **extra):
        import contextlib

        from vllm import LLM

        from layertap.engine import launch

        if ahead or wide:
            needs_queue(args, "plain-ahead" if ahead else "plain-wide")
        self.data = data
        # spawn (variant plain-spawn): the engine core spawned, as capture engines are (launch.engine_env);
        # plain vLLM forks it from this process, which has not touched CUDA
        env = launch.engine_env_set({launch.MP_METHOD_ENV: "spawn"}) if spawn else contextlib.nullcontext()
        with env:
            self.llm = LLM(model=str(model), **engine_kwargs(args, wide=wide), **extra)
        sp = gen_params(args)  # with --max-tokens 1, as the Tap's prompt mode
        self.params_for = lambda i: sp
        self.queue = args.queue and not wide  # wide: the driver keeps the target in an engine of more seats
        self.ahead = ahead

    def rate(self, inflight: int, data=None) -> float:
        data = self.data if data is None else data
        t0 = time.perf_counter()
        n = drive(self.llm.llm_engine, data, submit_limit(self, inflight, data), self.params_for)
        return n / (time.perf_counter() - t0)

    def engine(self):
        return self.llm.llm_engine

    def llm_handle(self):
        return self.llm

    def close(self) -> None:
        shutdown(self.llm)


class Floor(Plain):
    """The capture path's engine + the connector, which reports every save done without reading a row."""

    def __init__(self, model, data, args, gather: bool = False, **extra):
        from vllm import LLM

        from layertap.engine import compat, launch
        from layertap.engine.connector import PARAMS_KEY

        path = "hook"  # layertap's capture layer, capture's default path
        self.data = data
        self.queue = args.queue
        v = compat.check_version()
        kw = {**compat.engine_defaults(v, torch.cuda.is_available(), {}, path), **engine_kwargs(args)}
        conn = {"transport": {"backend": "shm"}, "run_meta": {}, "capture_path": path, "layer_ids": list(args.layers),
                **({"gather_only": True} if gather else {"skip_reads": True})}
        with launch.engine_env_set(launch.engine_env(torch.cuda.is_available(), kw)):
            self.llm = LLM(model=str(model), **launch.engine_capture_kwargs(path, args.layers, kw),
                           kv_transfer_config=launch.kv_transfer_config(conn), **kw, **extra)

        mode = record_mode(args)
        # one template whose extra_args each request replaces, as the Tap does (vLLM copies the params it is
        # given, compat.engine_copies_params): a new SamplingParams per request cost the driver ~0.09 ms between
        # a finished request and the next admission (turnaround 0.12 against plain's 0.03 ms on the CPU box)
        template = gen_params(args)
        shared = compat.engine_copies_params(v)

        def params_for(i):
            sp = template if shared else gen_params(args)
            sp.extra_args = {"kv_transfer_params": {PARAMS_KEY: {"index": i, "mode": mode, "run": "floor"}}}
            return sp

        self.params_for = params_for


def shm_slot_bytes(args) -> int:
    """One record per slot: ``--slot-mb``, or the record's rows (prompt x layers x hidden) plus room for its
    token ids and header."""
    if args.slot_mb is not None:
        return args.slot_mb << 20
    rows = args.prompt_len * len(args.layers) * args.hidden * getattr(torch, args.dtype).itemsize
    return rows + args.prompt_len * 9 + (64 << 10)


def shm_slots(args) -> int:
    """``--shm-slots``, or enough that the pool never caps the in-flight target: the Tap admits a request only
    while every running request and every record not yet consumed fits the pool's free slots."""
    if args.shm_slots is not None:
        return args.shm_slots
    if "capture-after" in args.variants:  # its records wait in the pool for a whole piece (CaptureAfter)
        return max(2 * max(args.batch_sizes) + 16, max(len(p) + b for b in args.batch_sizes
                                                        for p in chunks_of(list(range(args.prompts)), b, args.chunk)))
    return 2 * max(args.batch_sizes) + 16


class Capture:
    """layertap capture through the Tap: every record is counted and its token digest proven."""

    def __init__(self, model, data, args, wide: bool = False, **extra):
        from layertap.tap import Tap

        if wide:
            needs_queue(args, "capture-wide")
        self.inputs = [{"token_ids": ids} for ids in data]
        self.prompt_len = args.prompt_len
        # --max-tokens > 1: generate mode, each record holds the prompt's rows and every generated token's
        self.mode = record_mode(args)
        self.sp = gen_params(args) if self.mode == "generate" else None
        self.tap = Tap(model=model, layers=args.layers, transport=args.transport,
                       transport_config={"slot_bytes": shm_slot_bytes(args), "num_slots": shm_slots(args),
                                         "checksum": args.checksum} if args.transport == "shm" else None,
                       out=args.out if args.transport == "file" else None, zero_copy=args.transport == "shm",
                       **engine_kwargs(args, wide=wide), **extra)
        self.queue = args.queue and not wide
        # Default: at most the in-flight target in the engine, as drive() keeps plain's. --queue: the Tap's own
        # way, the target running (the engine's max_num_seqs) and as many more waiting in the engine's queue;
        # capture-wide: the Tap as it runs where the caller gives the engine more seats than max_inflight
        self.tap.lookahead = self.queue

    def rate(self, inflight: int, data=None) -> float:
        inputs = self.inputs if data is None else [{"token_ids": ids} for ids in data]
        self.tap.max_inflight = inflight
        t0 = time.perf_counter()
        count = 0
        for rec in self.tap.capture(inputs, mode=self.mode, sampling_params=self.sp):
            count += 1
            rec.release()
        dt = time.perf_counter() - t0
        if count != len(inputs):
            raise SystemExit(f"capture returned {count} records for {len(inputs)} requests")
        return sum(len(x["token_ids"]) for x in inputs) / dt

    def engine(self):
        return self.tap.llm.llm_engine

    def llm_handle(self):
        return self.tap.llm

    def close(self) -> None:
        self.tap.close()


class CaptureRaw(Capture):
    """The capture engine of ``capture`` (the same Tap, so the same engine and transport), driven request by
    request like ``plain`` and ``floor`` (``drive``), with a thread that takes each committed record off the
    transport and releases it. Records are counted, not proven. Set beside ``capture`` it splits capture's
    gap into the engine's (this variant) and the Tap's driving and proof (capture over this)."""

    def __init__(self, model, data, args, **extra):
        super().__init__(model, data, args, **extra)
        from layertap.engine.connector import PARAMS_KEY

        self.data = data
        sp = self.sp if self.sp is not None else gen_params(args)

        def params_for(i):
            p = sp.clone()
            p.extra_args = {"kv_transfer_params": {PARAMS_KEY: {"index": i, "mode": self.mode, "run": self.tap.run}}}
            return p

        self.params_for = params_for

    def rate(self, inflight: int, data=None) -> float:
        import threading

        data = self.data if data is None else data
        got, stop, errors = [0], threading.Event(), []

        def drain():
            try:
                while not stop.is_set() or got[0] < len(data):
                    for rec in self.tap.source.poll(timeout=0.05):
                        got[0] += 1
                        rec.release()
                    if stop.is_set() and time.monotonic() > deadline:
                        return
            except Exception as e:  # reported by the caller
                errors.append(e)

        deadline = float("inf")
        th = threading.Thread(target=drain, name="capture-raw-drain", daemon=True)
        th.start()
        t0 = time.perf_counter()
        try:
            n = drive(self.tap.llm.llm_engine, data, submit_limit(self, inflight, data), self.params_for)
        finally:
            deadline = time.monotonic() + 60
            stop.set()
            th.join()
        dt = time.perf_counter() - t0  # the records are all in when the drain thread ends
        if errors or got[0] != len(data):
            raise SystemExit(f"capture-raw: {got[0]} records for {len(data)} requests {errors[:1]}")
        return n / dt


class CaptureAfter(CaptureRaw):
    """``capture-raw`` with no record work in the driving process while the clock runs: the engine is driven
    like ``floor`` and the records stay in the pool until the call's last request finished; the clock stops
    there, then every record is taken off and counted (the pool must hold a whole call: use ``--chunk``).
    Beside ``floor`` (the same engine reading no rows) it is the engine's record path alone; capture /
    capture-after is what the driving process's record work (polls, proofs, releases, holding its GIL while
    the engine's next output waits to be decoded) costs."""

    def rate(self, inflight: int, data=None) -> float:
        data = self.data if data is None else data
        room = self.tap.source.free_capacity()
        if room is not None and room < len(data) + inflight:
            raise SystemExit(f"capture-after: the pool holds {room} records, a call needs {len(data) + inflight}; "
                             "pass --chunk (or --shm-slots)")
        t0 = time.perf_counter()
        n = drive(self.tap.llm.llm_engine, data, submit_limit(self, inflight, data), self.params_for)
        dt = time.perf_counter() - t0
        got, deadline = 0, time.monotonic() + 60
        while got < len(data) and time.monotonic() < deadline:
            for rec in self.tap.source.poll(timeout=0.05):
                got += 1
                rec.release()
        if got != len(data):
            raise SystemExit(f"capture-after: {got} records for {len(data)} requests")
        return n / dt


def profiler_kwargs(args, variant: str) -> dict:
    """Engine kwargs that let ``--profile-dir`` profile this engine later (nothing runs until asked)."""
    if not args.profile_dir:
        return {}
    from vllm.config import ProfilerConfig

    d = Path(args.profile_dir).resolve() / variant
    d.mkdir(parents=True, exist_ok=True)
    return {"profiler_config": ProfilerConfig(profiler="torch", torch_profiler_dir=str(d), torch_profiler_with_stack=False,
                                              torch_profiler_use_gzip=True, torch_profiler_record_shapes=False)}


VARIANTS = {
    "plain": lambda m, d, a: Plain(m, d, a, **profiler_kwargs(a, "plain")),
    "plain-spawn": lambda m, d, a: Plain(m, d, a, spawn=True, **profiler_kwargs(a, "plain-spawn")),
    "plain-ahead": lambda m, d, a: Plain(m, d, a, ahead=True, **profiler_kwargs(a, "plain-ahead")),
    "plain-wide": lambda m, d, a: Plain(m, d, a, wide=True, **profiler_kwargs(a, "plain-wide")),
    "plain-sync": lambda m, d, a: Plain(m, d, a, async_scheduling=False, **profiler_kwargs(a, "plain-sync")),
    "floor": lambda m, d, a: Floor(m, d, a, **profiler_kwargs(a, "floor")),
    "floor-gather": lambda m, d, a: Floor(m, d, a, gather=True, **profiler_kwargs(a, "floor-gather")),
    "capture": lambda m, d, a: Capture(m, d, a, **profiler_kwargs(a, "capture")),
    "capture-inproc": lambda m, d, a: Capture(m, d, a, connector_options={"offload": False},
                                              **profiler_kwargs(a, "capture-inproc")),
    "capture-nocopy": lambda m, d, a: Capture(m, d, a, connector_options={"offload_rows": "skip"},
                                              **profiler_kwargs(a, "capture-nocopy")),
    "capture-nogpu": lambda m, d, a: Capture(m, d, a, connector_options={"offload_rows": "nogpu"},
                                             **profiler_kwargs(a, "capture-nogpu")),
    "capture-loud": lambda m, d, a: Capture(m, d, a, connector_options={"quiet_empty_steps": False},
                                            **profiler_kwargs(a, "capture-loud")),
    "capture-raw": lambda m, d, a: CaptureRaw(m, d, a, **profiler_kwargs(a, "capture-raw")),
    "capture-after": lambda m, d, a: CaptureAfter(m, d, a, **profiler_kwargs(a, "capture-after")),
    "capture-wide": lambda m, d, a: Capture(m, d, a, wide=True, **profiler_kwargs(a, "capture-wide")),
    "capture-sync": lambda m, d, a: Capture(m, d, a, async_scheduling=False, **profiler_kwargs(a, "capture-sync")),
    "capture-extract": lambda m, d, a: Capture(m, d, a, capture_path="extract", **profiler_kwargs(a, "capture-extract")),
}


def profile_engines(runners: dict, data, args) -> dict[str, dict]:
    """Profile every engine over a few requests per in-flight target; returns summaries by "variant@k"."""
    import trace_summary

    out: dict[str, dict] = {}
    for k in args.profile_inflight:
        n = args.profile_requests or max(16, 4 * k)
        for v, r in runners.items():
            llm = r.llm_handle()
            r.rate(k, data[:n])  # the same shapes once more, unprofiled
            llm.start_profile(profile_prefix=f"{v}_inflight{k}")
            r.rate(k, data[:n])
            llm.stop_profile()
            d = Path(args.profile_dir).resolve() / v
            traces = sorted((p for p in d.rglob("*.json*") if p.name.startswith(f"{v}_inflight{k}")),
                            key=lambda p: p.stat().st_mtime)
            if not traces:
                print(f"  profile {v}@{k}: no trace in {d} ({sorted(p.name for p in d.rglob('*'))[:8]})", flush=True)
                continue
            out[f"{v}@{k}"] = summary = trace_summary.summarize(traces[-1], requests=n)
            (d / f"{v}_inflight{k}.summary.json").write_text(json.dumps(summary, indent=1))
            print(f"  profiled {v} at {k} in flight: {traces[-1].name}", flush=True)
    return out


def measure(variants: list[str], model, data, args) -> dict[str, dict]:
    """tokens/s of every (variant, batch size), ``args.repeats`` times.

    Paired (the default): every variant's engine is alive at once, and one round measures each batch size
    on every engine back to back (the order rotates each round), so slow drift of the machine (clocks,
    other tenants) hits all variants alike and ratios are taken within a round. Separate
    (``len(variants) == 1``): one engine, its rounds in a row."""
    runners = {}
    try:
        for v in variants:
            runners[v] = VARIANTS[v](model, data, args)
        for r in runners.values():  # warm-up: every batch size's shapes once, on a slice of the data
            for b in args.batch_sizes:
                r.rate(b, data[: max(b, min(len(data), 2 * b))])
        timelines = {v: Timeline(r.engine(), late_by=args.stats) for v, r in runners.items()}
        out: dict[str, dict[int, list[float]]] = {v: {b: [] for b in args.batch_sizes} for v in variants}
        seen: dict[str, dict[int, list[dict]]] = {v: {b: [] for b in args.batch_sizes} for v in variants}
        pieces: dict[str, dict[int, list[list[float]]]] = {v: {b: [] for b in args.batch_sizes} for v in variants}
        for rnd in range(args.repeats):
            for b in args.batch_sizes:
                k = (rnd + args.batch_sizes.index(b)) % len(variants)
                order = variants[k:] + variants[:k]
                spent = dict.fromkeys(variants, 0.0)
                rates: dict[str, list[float]] = {v: [] for v in variants}
                for v in variants:
                    timelines[v].reset()
                deferred0 = {v: getattr(getattr(runners[v], "tap", None), "deferrals", 0) for v in variants}
                parts = chunks_of(data, b, args.chunk)
                for i, part in enumerate(parts):  # each piece on every engine back to back, order rotating
                    j = i % len(order)
                    for v in order[j:] + order[:j]:
                        t_call = time.monotonic()
                        rates[v].append(runners[v].rate(b, part))
                        spent[v] += sum(map(len, part)) / rates[v][-1]
                        timelines[v].segment((t_call, time.monotonic()))
                for v in order:
                    out[v][b].append(sum(map(len, data)) / spent[v])
                    pieces[v][b].append(rates[v])
                    seen[v][b].append(timelines[v].summary(b))
                    tl = seen[v][b][-1]
                    if tl and hasattr(runners[v], "tap"):  # rounds of the Tap's loop in which records waited
                        tl["deferrals"] = runners[v].tap.deferrals - deferred0[v]
                    print(f"  round {rnd + 1}/{args.repeats} in-flight {b:>3} {v:>22}: {out[v][b][-1]:>10.0f} tok/s"
                          + (f" ({len(parts)} pieces)" if len(parts) > 1 else "")
                          + (f"  (occupancy {tl['occupancy']:.2f}, latency {tl['latency_ms']:.1f} ms, "
                             f"mean {tl['latency_mean_ms']:.1f}, p90 {tl['latency_p90_ms']:.1f}, "
                             f"{tl['per_output']:.0f} per output"
                             + "".join(f", {p} {tl[p + '_ms']:.2f}" for p in ("turnaround", *Timeline.PHASES)
                                       if p + "_ms" in tl)
                             + (f", {tl['deferrals']} deferrals" if "deferrals" in tl else "")
                             + (f", outside requests {100 * tl['outside']:.1f}% (head {tl['head_ms']:.2f} / tail "
                                f"{tl['tail_ms']:.2f} ms a call)" if "outside" in tl else "") + ")" if tl else ""),
                          flush=True)
                    if tl.get("late_by"):
                        print("      late by the driver's code then (ms a request): " + "; ".join(
                            f"{k} {v:.3f}" for k, v in tl["late_by"].items()), flush=True)
        profiles = profile_engines(runners, data, args) if args.profile_dir else {}
        return {"rates": out, "pieces": pieces, "timeline": seen, "profiles": profiles}
    finally:
        for r in runners.values():
            r.close()


@torch.no_grad()
def bench_hf(model, data, args) -> float:
    from transformers import AutoModelForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype).to(dev).eval()
    bs = args.hf_batch

    def run(rows):
        for i in range(0, len(rows), bs):
            ids = torch.tensor(rows[i : i + bs], device=dev)
            hs = m.model(input_ids=ids, output_hidden_states=True).hidden_states
            host = [hs[j].to("cpu") for j in args.layers if j < len(hs)]  # what a user stores
            del host

    run(data[:bs])
    if dev == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(data)
    if dev == "cuda":
        torch.cuda.synchronize()
    rate = len(data) * args.prompt_len / (time.perf_counter() - t0)
    del m
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="captured layer ids (default: 4 ids spread over the model, as an EAGLE-3 run would)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=1,
                    help="new tokens per request (default 1: prefill only; more: decode-heavy steps, generate-mode "
                         "records; throughput still counts prompt tokens)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--gpu-build", action="store_true",
                    help="make the random model's weights on the GPU and save them in --dtype (an 8B-shaped model "
                         "in seconds instead of minutes on the CPU in float32)")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    ap.add_argument("--gpu-mem", type=float, default=None,
                    help="gpu_memory_utilization of each engine (default 0.35, or 0.8 / number of variants when paired)")
    ap.add_argument("--transport", default="shm", choices=["shm", "file"])
    ap.add_argument("--checksum", default="none",
                    help="shm payload checksum (crc32|sum64|none; the token digest is always checked)")
    ap.add_argument("--shm-slots", type=int, default=None,
                    help="shm pool slots (default: 2 x the largest in-flight target + 16, so the pool never caps it)")
    ap.add_argument("--slot-mb", type=int, default=None, help="shm slot size in MiB (default: one record's size)")
    ap.add_argument("--out", default="/dev/shm/layertap-bench", help="file transport: dataset directory")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size of every vLLM engine")
    ap.add_argument("--queue", action="store_true",
                    help="in flight = the engine's max_num_seqs, as vLLM users set it: each batch size gets engines "
                         "of its own, every prompt of a call is submitted at once (plain, floor; the Tap admits as "
                         "far as max_inflight's lookahead and its pool allow), so finished requests are replaced "
                         "from the engine's own queue. "
                         "Default: one engine per variant, the driver keeps the in-flight target in it (a finished "
                         "request's successor is added after its output reaches the driver)")
    ap.add_argument("--wide-seqs", type=int, default=64,
                    help="max_num_seqs of the -wide variants' engines (--queue), fed the in-flight target by the "
                         "driver (default 64; vLLM's own default for LLM on an 80 GB GPU is 1024)")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["plain", "capture"],
                    help=f"comma-separated, from {list(VARIANTS)}; must include plain and capture")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF second pass")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over all batch sizes (default 3)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="measure each round in pieces of at least this many prompts (and 4 x the in-flight "
                         "target), every engine on a piece before the next piece, so that the host's drift "
                         "within a round hits every variant alike; a round's rate is its tokens over the time "
                         "of all its pieces (default: the whole prompt set per engine, one after the other)")
    ap.add_argument("--stats", action="store_true",
                    help="turn vLLM's per-request stats on in every engine and split each request's time at the "
                         "engine core's timestamps (in / wait / run / out, see Timeline)")
    ap.add_argument("--separate", action="store_true",
                    help="one child process per variant, measured one after the other (default: paired, all "
                         "engines alive in one child process, measured in interleaved rounds)")
    ap.add_argument("--profile-dir", default=None,
                    help="after the rounds, profile each engine (torch profiler, CPU + CUDA) into this directory")
    ap.add_argument("--profile-inflight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="in-flight targets to profile at (default 1,4)")
    ap.add_argument("--profile-requests", type=int, default=None,
                    help="requests per profiled run (default max(16, 4 x in flight); fewer for long decodes)")
    ap.add_argument("--cpus", default=None,
                    help="run the driver and every engine on these CPUs: node:N (NUMA node N's) or a list such as "
                         "0-7,16 (default: all; the host's NUMA layout is printed either way)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: "V1,V2:RESULT.json"
    args = ap.parse_args(argv)
    n = args.num_layers
    args.layers = args.layers or sorted({1, max(1, n // 2), max(1, n - 3), n})
    for v in args.variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; expected some of {list(VARIANTS)}")
    if "plain" not in args.variants:
        raise SystemExit("--variants must include plain (every ratio is over plain)")
    if args.gpu_mem is None:  # paired: every engine lives at once and needs its share of the GPU
        args.gpu_mem = 0.35 if args.separate else min(0.35, 0.8 / len(args.variants))
    return args


def main() -> None:
    args = parse_args()
    n = args.num_layers
    model = build_model(args)
    data = prompts(args)
    if args.child:
        vs, path = args.child.split(":", 1)
        Path(path).write_text(json.dumps(measure(vs.split(","), model, data, args)))
        return
    if args.cpus:  # every engine process and thread started from here inherits the affinity
        os.sched_setaffinity(0, resolve_cpus(args.cpus))
    host = host_line()
    print(host, flush=True)
    # Engines run in child processes (on the H200 an engine started in the same process after a closed
    # capture engine hung at start-up), so this process never holds an engine.
    groups = [[v] for v in args.variants] if args.separate else [list(args.variants)]
    res: dict[str, dict[int, list[float]]] = {}
    timeline: dict[str, dict[int, list[dict]]] = {}
    pieces: dict[str, dict[int, list[list[float]]]] = {}
    profiles: dict[str, dict] = {}
    # --queue: engines of their own for each batch size (max_num_seqs is fixed at an engine's start)
    sizes = [[b] for b in args.batch_sizes] if args.queue else [None]
    for group in groups:
        for only in sizes:
            print(f"--- {', '.join(group)}" + (f" (max_num_seqs {only[0]})" if only else ""), flush=True)
            extra = ["--batch-sizes", str(only[0])] if only else []
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "result.json"
                rc = subprocess.call([sys.executable, __file__, *sys.argv[1:], *extra,
                                      "--child", f"{','.join(group)}:{out}"])
                if rc != 0 or not out.exists():
                    raise SystemExit(f"variants {group} failed (exit {rc})")
                got = json.loads(out.read_text())
                for v, by_b in got["rates"].items():
                    res.setdefault(v, {}).update({int(b): rates for b, rates in by_b.items()})
                for v, by_b in got.get("pieces", {}).items():
                    pieces.setdefault(v, {}).update({int(b): p for b, p in by_b.items()})
                for v, by_b in got["timeline"].items():
                    timeline.setdefault(v, {}).update({int(b): tls for b, tls in by_b.items()})
                profiles.update(got.get("profiles", {}))
    hf = bench_hf(model, data, args) if not args.no_hf else float("nan")
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\ncapture overhead on {dev}: {args.prompts} x {args.prompt_len}-token prefill, hidden {args.hidden}, "
          f"{n} layers, {args.dtype}, {'eager' if args.eager else 'compiled'}, layers {args.layers}, "
          f"transport {args.transport}, tensor parallel {args.tp}; {args.repeats} rounds, "
          + ("in flight = max_num_seqs, every prompt of a call submitted at once (--queue); " if args.queue else "")
          + f"{'separate processes, one variant after another' if args.separate else 'paired (engines side by side, interleaved)'}")
    print("tokens/s: median over rounds; ratio: median over rounds of (variant / plain) "
          + ("in the same round" if not args.separate else "of the round with the same number") + ", [min-max]")
    rows = []
    others = [v for v in args.variants if v != "plain"]
    print(f"{'in-flight':>9} {'plain tok/s':>12}" + "".join(f" {v:>30}" for v in others)
          + ("  capture vs HF" if "capture" in res else ""))
    for b in args.batch_sizes:
        plain = res["plain"][b]
        row = {"batch": b, "plain": statistics.median(plain), "plain_rounds": plain}
        line = f"{b:>9} {row['plain']:>12.0f}"
        for v in others:
            ratios = [x / y for x, y in zip(res[v][b], plain)]
            row[v] = statistics.median(res[v][b])
            row[f"{v}_rounds"] = res[v][b]
            row[f"{v}_ratio"] = statistics.median(ratios)
            row[f"{v}_ratio_range"] = [min(ratios), max(ratios)]
            line += f" {row[v]:>10.0f} {row[f'{v}_ratio']:>5.2f} [{min(ratios):.2f}-{max(ratios):.2f}]".rjust(31)
            pr = piece_ratios(pieces, v, b)
            if pr:  # --chunk: every piece's pair, pooled over the rounds
                q = statistics.quantiles(pr, n=10) if len(pr) > 1 else [pr[0]] * 9
                row[f"{v}_piece_ratio"], row[f"{v}_piece_ratio_p10_p90"] = statistics.median(pr), [q[0], q[-1]]
                row[f"{v}_pieces"] = len(pr)
        if "capture" in res:
            row["ratio"], row["vs_hf"] = row["capture_ratio"], row["capture"] / hf
            line += f"  {row['vs_hf']:>5.1f}x"
        rows.append(row)
        print(line)
    print(f"HF transformers second pass (batch {args.hf_batch}, layers copied to host): {hf:.0f} tok/s")
    if args.chunk:
        print("\nper piece (--chunk): median of (variant / plain) over every piece of every round [p10-p90], pieces")
        for row in [r for r in rows if any(f"{v}_piece_ratio" in r for v in others)]:
            print(f"{row['batch']:>9} " + "".join(
                f" {v:>14} {row[f'{v}_piece_ratio']:.3f} [{row[f'{v}_piece_ratio_p10_p90'][0]:.2f}-"
                f"{row[f'{v}_piece_ratio_p10_p90'][1]:.2f}] n={row[f'{v}_pieces']}" for v in others if f"{v}_piece_ratio" in row))
    print_timeline(timeline, args)
    if profiles:
        import trace_summary

        for k in args.profile_inflight:
            got = {name: p for name, p in profiles.items() if name.endswith(f"@{k}")}
            print(f"\ntorch profiler, {k} in flight (per request; the worker process):")
            print(trace_summary.compare(got))
            base = f"plain@{k}"
            for name in got:
                if name != base and base in got:  # what each engine runs on the GPU that plain does not
                    print(f"\nGPU kernels, plain -> {name.split('@')[0]} ({k} in flight):")
                    print(trace_summary.kernel_diff(got[base], got[name]))
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "host": host, "args": vars(args), "rows": rows, "hf": hf,
                                               "timeline": timeline, "profiles": profiles}, indent=1))


def piece_ratios(pieces: dict[str, dict[int, list[list[float]]]], v: str, b: int) -> list[float]:
    """(variant / plain) of every piece of every round at ``b`` in flight: the pairs run back to back."""
    if v not in pieces or "plain" not in pieces:
        return []
    return [x / y for rv, rp in zip(pieces[v][b], pieces["plain"][b]) if len(rv) > 1 for x, y in zip(rv, rp)]


def print_timeline(timeline: dict[str, dict[int, list[dict]]], args) -> None:
    """Medians over rounds of the driver-side timeline (see ``Timeline``)."""
    print("\ndriver's view (median over rounds): occupancy of the in-flight target / request latency ms, median "
          "and mean / requests finished per engine output")
    print(f"{'in-flight':>9}" + "".join(f" {v:>34}" for v in args.variants))
    for b in args.batch_sizes:
        line = f"{b:>9}"
        for v in args.variants:
            tls = [t for t in timeline.get(v, {}).get(b, []) if t]
            if not tls:
                line += f" {'-':>34}"
                continue
            med = {k: statistics.median(t[k] for t in tls)
                   for k in ("occupancy", "latency_ms", "latency_mean_ms", "per_output")}
            line += (f" {med['occupancy']:>8.2f} {med['latency_ms']:>9.1f} {med['latency_mean_ms']:>7.1f} "
                     f"{med['per_output']:>7.1f}")
        print(line)
    if any("outside" in t for by_b in timeline.values() for tls in by_b.values() for t in tls if t):
        print("\ntime outside any request, median over rounds: share of the variant's measured time / head / tail "
              "ms a call (head: call to first admission; tail: last finished request to return, for capture the "
              "last records' landing and proof)")
        print(f"{'in-flight':>9}" + "".join(f" {v:>34}" for v in args.variants))
        for b in args.batch_sizes:
            line = f"{b:>9}"
            for v in args.variants:
                tls = [t for t in timeline.get(v, {}).get(b, []) if t and "outside" in t]
                line += (f" {'-':>34}" if not tls else
                         f" {100 * statistics.median(t['outside'] for t in tls):>15.1f}% "
                         f"{statistics.median(t['head_ms'] for t in tls):>8.2f} "
                         f"{statistics.median(t['tail_ms'] for t in tls):>8.2f}")
            print(line)
    keys = [k for k in ("turnaround", *Timeline.PHASES)
            if any(f"{k}_ms" in t for by_b in timeline.values() for tls in by_b.values() for t in tls if t)]
    if not keys:
        return
    print(f"\nper request, ms (median over rounds of each round's median): {' / '.join(keys)}"
          + (" (in / wait / run / out: the engine core's timestamps, --stats; out = send + late + proc)"
             if "run" in keys else ""))
    width = max(34, 8 * len(keys))
    print(f"{'in-flight':>9}" + "".join(f" {v:>{width}}" for v in args.variants))
    for b in args.batch_sizes:
        line = f"{b:>9}"
        for v in args.variants:
            tls = [t for t in timeline.get(v, {}).get(b, []) if t]
            vals = [statistics.median(t[f"{k}_ms"] for t in tls) if tls and all(f"{k}_ms" in t for t in tls) else
                    float("nan") for k in keys]
            line += " " + " / ".join(f"{x:.2f}" for x in vals).rjust(width)
        print(line)


if __name__ == "__main__":
    main()
