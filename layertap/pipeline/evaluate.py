"""Acceptance in vLLM, in a child process: ``python -m layertap.pipeline.evaluate JOB.json RESULT.json``.

A child process because vLLM's Prometheus counters are process-global: the capture engine of the run
(an ``extract_hidden_states`` "drafter") would otherwise count into the evaluation's deltas. The child
runs ``layertap.train.eval.run_eval`` (plain decoding, ngram, the drafter, outputs compared) for the
final table, or only the drafter for the intermediate points of the acceptance curve.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

log = logging.getLogger("layertap")


def drafter_only(target: str, drafters: dict[str, dict[str, Any]], prompts: list[list[int]], *,
                 max_tokens: int, engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Acceptance of each drafter without the plain/ngram baselines (intermediate evaluations)."""
    from layertap.train.eval import _engine, _generate, _snapshot, spec_result

    results = []
    for name, spec in drafters.items():
        llm = _engine(target, spec, engine_kwargs)
        before = _snapshot(llm)
        _generate(llm, prompts, max_tokens)
        results.append(asdict(spec_result(name, before, _snapshot(llm))))
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    return {"num_prompts": len(prompts), "max_tokens": max_tokens, "results": results}


def timed_decode(llm: Any, prompts: list[list[int]], *, batch_size: int, max_tokens: int,
                 speculative: bool = True, step_timeout_s: float = 120.0,
                 top2: bool = False) -> dict[str, Any]:
    """Greedy decoding of ``prompts`` with ``batch_size`` requests in flight: a new request enters as soon
    as one finishes (continuous batching, as a server at that concurrency sees it).

    Consecutive ``generate`` calls of ``batch_size`` prompts would instead time each batch by its slowest
    request; with speculation the requests of a batch finish far apart (their acceptance differs), so a
    batch ran mostly with one or two requests left and the number measured the tail, not the batch size.

    Returns the outputs (token ids per prompt, in prompt order), the seconds and output tokens (one-element
    lists, the shape of merged repeats), output tokens/s, per-request decode time per output token (first to
    last token; median and p99 in ms), and, when ``speculative``, vLLM's acceptance from its own counters
    (``spec_result``; the engine needs ``disable_log_stats=False``). A step that returns nothing for
    ``step_timeout_s`` while requests are open is an error, not a wait.

    ``top2``: also ``top2`` per prompt, per output position ``[margin, runner-up]``: the top-1 minus top-2
    logprob there and the runner-up token (vLLM's ``logprobs=2``; costs time: not for timed runs)."""
    import statistics

    from vllm import SamplingParams

    from layertap.train.eval import _snapshot, spec_result

    if batch_size < 1 or not prompts:
        raise ValueError(f"timed_decode needs batch_size >= 1 and prompts (got {batch_size}, {len(prompts)})")
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("timed_decode: the engine already has unfinished requests")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2 if top2 else None)
    before = _snapshot(llm) if speculative else None
    ids: dict[int, list[int]] = {}
    runner_up: dict[int, list[list[float]]] = {}
    first: dict[str, float] = {}
    tpot_ms: list[float] = []
    nxt = 0

    def admit() -> None:
        nonlocal nxt
        # Outputs carry the id given here (add_request returns vLLM's internal one, a suffix added).
        engine.add_request(f"td-{nxt}", {"prompt_token_ids": list(prompts[nxt])}, params)
        nxt += 1

    t0 = time.perf_counter()
    while nxt < min(batch_size, len(prompts)):
        admit()
    idle_since = time.monotonic()
    while len(ids) < len(prompts):
        step = engine.step()
        now = time.perf_counter()
        if step:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > step_timeout_s:
            raise TimeoutError(f"timed_decode: no output for {step_timeout_s:.0f} s with "
                               f"{len(prompts) - len(ids)} requests open")
        for out in step:
            rid = out.request_id
            if not rid.startswith("td-"):
                raise RuntimeError(f"timed_decode: output for a request it did not add: {rid!r}")
            if rid not in first and out.outputs and len(out.outputs[0].token_ids) > 0:
                first[rid] = now
            if out.finished:
                toks = list(out.outputs[0].token_ids)
                ids[int(rid[3:])] = toks
                if top2:
                    runner_up[int(rid[3:])] = _top2(out.outputs[0].logprobs, toks)
                if len(toks) > 1 and rid in first:
                    tpot_ms.append(1e3 * (now - first[rid]) / (len(toks) - 1))
                if nxt < len(prompts):
                    admit()
    seconds = time.perf_counter() - t0
    outputs = [ids[i] for i in range(len(prompts))]
    n = sum(len(x) for x in outputs)
    tpot_ms.sort()
    res: dict[str, Any] = {
        "batch_size": batch_size, "mode": "continuous", "num_prompts": len(prompts), "max_tokens": max_tokens,
        "seconds": [seconds], "output_tokens": [n], "output_tokens_per_s": n / max(seconds, 1e-9),
        "outputs": outputs,
        "tpot_ms_median": statistics.median(tpot_ms) if tpot_ms else None,
        "tpot_ms_p99": tpot_ms[min(len(tpot_ms) - 1, int(0.99 * len(tpot_ms)))] if tpot_ms else None}
    if top2:
        res["top2"] = [runner_up[i] for i in range(len(prompts))]
    if speculative:
        res["acceptance"] = asdict(spec_result(f"batch {batch_size}", before, _snapshot(llm)))
    return res


def _top2(logprobs: Any, toks: list[int]) -> list[list[float]]:
    """Per position ``[top-1 - top-2 logprob, runner-up token]`` from vLLM's per-position logprob dicts (the
    sampled token plus the top 2); the greedy token must be the top one, else the output is not greedy."""
    if logprobs is None or len(logprobs) != len(toks):
        raise RuntimeError(f"timed_decode(top2=True): {0 if logprobs is None else len(logprobs)} logprob "
                           f"positions for {len(toks)} tokens")
    rows = []
    for pos, (d, tok) in enumerate(zip(logprobs, toks)):
        ranked = sorted(d.items(), key=lambda kv: -kv[1].logprob)
        if len(ranked) < 2:
            raise RuntimeError(f"timed_decode(top2=True): position {pos} has {len(ranked)} logprobs, not 2")
        if ranked[0][0] != tok and ranked[0][1].logprob > d[tok].logprob:
            raise RuntimeError(f"timed_decode(top2=True): position {pos}: greedy token {tok} is not the top one "
                               f"({ranked[0][0]})")
        second = next((t, lp) for t, lp in ranked if t != tok)
        rows.append([float(d[tok].logprob - second[1].logprob), int(second[0])])
    return rows


def first_divergence(out: list[int], ref: list[int]) -> int | None:
    """The first position where ``out`` and ``ref`` differ (a length difference counts at the shorter's
    end), or None when they are equal."""
    for i, (a, b) in enumerate(zip(out, ref)):
        if a != b:
            return i
    return None if len(out) == len(ref) else min(len(out), len(ref))


EVAL_GPU_MEMORY_UTILIZATION = 0.05
"""On CUDA, the evaluation engines' ``gpu_memory_utilization``. Their KV cache is ``kv_cache_memory_bytes``,
so this value only feeds vLLM's start-up check (free memory >= utilization x total); at vLLM's default
(0.9) an evaluation started next to the capture engine and the trainer on one GPU would be refused."""


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    from layertap.train.eval import run_eval

    kw = {"target": job["target"], "drafters": job["drafters"], "prompts": job["prompts"],
          "max_tokens": job["max_tokens"], "engine_kwargs": job["engine_kwargs"]}
    if job["baseline"]:
        res = run_eval(**kw, ngram_k=job["ngram_k"], verbose=False)
    else:
        res = drafter_only(**kw)
    res["step"] = job["step"]
    return res


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m layertap.pipeline.evaluate JOB.json RESULT.json", file=sys.stderr)
        return 2
    import torch

    job = json.loads(Path(argv[0]).read_text())
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    kw = job["engine_kwargs"]
    if torch.cuda.is_available() and "kv_cache_memory_bytes" in kw:
        kw.setdefault("gpu_memory_utilization", EVAL_GPU_MEMORY_UTILIZATION)
    res = run_job(job)
    tmp = Path(argv[1]).with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    os.replace(tmp, argv[1])
    return 0


class EvalRunner:
    """Evaluation children: at most one in the background; ``final`` runs in the foreground."""

    def __init__(self, out: Path, target: str, prompts: list[list[int]], *, max_tokens: int, ngram_k: int,
                 kv_cache_mb: int):
        self.dir = out / "evals"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.base = {"target": target, "prompts": prompts, "max_tokens": max_tokens, "ngram_k": ngram_k,
                     "engine_kwargs": {"kv_cache_memory_bytes": kv_cache_mb << 20, "max_model_len": 1024,
                                       "enforce_eager": True}, "threads": 1}
        self.proc: subprocess.Popen | None = None
        self.proc_step: int | None = None
        self.results: list[dict[str, Any]] = []
        self.skipped: list[int] = []

    def load_earlier(self, step: int, max_steps: int) -> None:
        """A resumed run's evaluations made by its earlier invocations: each result file of a step up to
        ``step`` (where the run resumes) joins ``results``; a job without a result (its invocation ended
        while it ran) is noted in ``skipped``. The last step is left to the final evaluation."""
        for jp in sorted(self.dir.glob("job-*.json"), key=lambda p: int(p.stem.split("-")[1])):
            s = int(jp.stem.split("-")[1])
            if s > step or s >= max_steps or json.loads(jp.read_text()).get("baseline"):
                continue  # not yet due again, or a final evaluation (it runs again at the end)
            rp = self.dir / f"result-{s}.json"
            if rp.exists():
                self.results.append(json.loads(rp.read_text()))
            else:
                self.skipped.append(s)

    def _spawn(self, step: int, drafters: dict[str, dict[str, Any]], baseline: bool) -> tuple[subprocess.Popen, Path]:
        job = {**self.base, "drafters": drafters, "baseline": baseline, "step": step}
        jp, rp = self.dir / f"job-{step}.json", self.dir / f"result-{step}.json"
        jp.write_text(json.dumps(job))
        logf = open(self.dir / f"eval-{step}.log", "w")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen([sys.executable, "-m", "layertap.pipeline.evaluate", str(jp), str(rp)],
                                stdout=logf, stderr=subprocess.STDOUT)
        logf.close()
        return proc, rp

    def submit(self, step: int, drafters: dict[str, dict[str, Any]]) -> bool:
        """Start a background evaluation of this step's export; skipped (and noted) while one runs."""
        self.collect()
        if self.proc is not None:
            self.skipped.append(step)
            return False
        self.proc, _ = self._spawn(step, drafters, baseline=False)
        self.proc_step = step
        return True

    def collect(self, wait: bool = False) -> None:
        if self.proc is None or (not wait and self.proc.poll() is None):
            return
        rc = self.proc.wait()
        step, self.proc, self.proc_step = self.proc_step, None, None
        rp = self.dir / f"result-{step}.json"
        if rc != 0 or not rp.exists():
            raise RuntimeError(f"evaluation of step {step} failed (exit {rc}); see {self.dir}/eval-{step}.log")
        self.results.append(json.loads(rp.read_text()))

    def final(self, step: int, drafters: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Plain + ngram + drafter, in the foreground; waits for a background evaluation first."""
        self.collect(wait=True)
        proc, rp = self._spawn(step, drafters, baseline=True)
        self.proc, self.proc_step = proc, None
        rc = proc.wait()
        self.proc = None
        if rc != 0 or not rp.exists():
            raise RuntimeError(f"final evaluation failed (exit {rc}); see {self.dir}/eval-{step}.log")
        res = json.loads(rp.read_text())
        self.results.append(res)
        return res

    def close(self, timeout: float = 20.0) -> None:
        """Stop a running child and its vLLM engine process (SIGTERM, then SIGKILL): nothing outlives the run."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        stop_tree(proc.pid, timeout)


def stop_tree(pid: int, timeout: float) -> None:
    """SIGTERM ``pid`` and its descendants (listed before signalling), SIGKILL what is left after ``timeout``;
    then unlink the shared-memory segments they mapped that nobody maps any more."""
    import psutil

    from layertap.engine.watchdog import mapped_segments, unlink_orphans

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    segments = mapped_segments([p.pid for p in procs])  # vLLM's queues; a killed engine leaves them behind
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        log.error("process %d ignored SIGTERM for %.0fs; killing it", p.pid, timeout)
        try:
            p.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(alive, timeout=5)
    unlink_orphans(segments)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main(sys.argv[1:]))
