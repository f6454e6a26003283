"""Per-step CPU cost of layertap's engine-side work: plain vLLM vs ``floor`` (hook capture engine + the
layertap connector, reading no rows) vs ``capture`` (rows read, records written into the shm pool).

Each variant's engine runs in a child process of its own (vLLM's KV-connector agent is a process global,
so engines with and without the connector cannot share a process), with its engine core and worker
stepping in that process's calling thread (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker). A tiny model
and short prompts keep the model's forward cheap, so per-step overhead dominates: what the engine core's
one CPU thread pays per step, which on a GPU host shows up 1:1 in throughput. Measured: the wall time of
``LLMEngine.step()`` (the engine core's step plus the frontend's output processing, the same for every
variant), summed over a round and divided by the steps it took. The parent runs the variants' rounds one
at a time, interleaved (order rotating), and prints medians and the ratio against plain in the same round.
A before/after comparison of the code needs two runs (two checkouts); on the 2-core CI machine the
round-to-round spread is about +-10%, so small changes show in the torch-call counts, not in the times.

Then, one counting pass per variant (not timed): Python-level torch calls per step (a ``TorchFunctionMode``
sees every ``torch.*`` function and tensor method called in the stepping thread), in total and those whose
caller (the first frame outside torch) is layertap's engine / transport code or vLLM's KV-connector
plumbing, by caller; attribute reads (``.shape``, ``.dtype``) are counted apart from ops. On a GPU each op
costs launch or dispatch time (10-30 us on the H200 host).

    .venv/bin/python benchmarks/connector_step_cost.py                      # defaults: 64-token prompts, 1 and 4 in flight
    .venv/bin/python benchmarks/connector_step_cost.py --profile capture    # + cProfile of layertap's functions per step
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM is imported

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import capture_overhead as co  # noqa: E402

VARIANTS = ("plain", "floor", "capture")


class StepClock:
    """Wraps one engine's ``step``: wall time and count of the calls, optionally under a profiler/mode."""

    def __init__(self, engine):
        self.engine, self.inner = engine, engine.step
        self.t, self.n = 0.0, 0
        self.around = None  # a context-manager factory entered around each step (counting passes)

        def step():
            self.n += 1
            if self.around is not None:  # a counting or profiling pass: not timed
                with self.around():
                    return self.inner()
            t0 = time.perf_counter()
            try:
                return self.inner()
            finally:
                self.t += time.perf_counter() - t0

        engine.step = step

    def reset(self) -> None:
        self.t, self.n = 0.0, 0


ROOTS = ("/layertap/engine/", "/layertap/transport/", "/layertap/records", "/kv_transfer/", "kv_connector")
"""Files whose functions count as layertap's engine-side work or vLLM's KV-connector plumbing."""


def _where(frame) -> str:
    """The torch call's caller (the first frame outside torch) when it is layertap's engine code or vLLM's
    KV-connector plumbing, else ``other``."""
    f = frame
    while f is not None and "/torch/" in f.f_code.co_filename:
        f = f.f_back
    if f is None:
        return "other"
    fn = f.f_code.co_filename
    if any(r in fn for r in ROOTS):
        short = fn.split("/layertap/")[-1] if "/layertap/" in fn else fn.split("/vllm/")[-1]
        return f"{short}:{f.f_code.co_name}"
    return "other"


class CountTorch(TorchFunctionMode):
    def __init__(self, counts: Counter, where: Counter):
        super().__init__()
        self.counts, self.where = counts, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.counts["all"] += 1
        loc = _where(sys._getframe(1))
        if loc != "other":
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            self.counts["layertap+connector"] += 1
            if not name.startswith("getset_descriptor"):  # .shape, .dtype, .is_cuda: no dispatcher call
                self.counts["layertap+connector ops"] += 1
            self.where[f"{loc} -> {name}"] += 1
        return func(*args, **(kwargs or {}))


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=48, help="requests per round and variant")
    ap.add_argument("--inflight", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=1,
                    help="new tokens per request (default 1: every step a prefill; e.g. 32: mostly decode steps, "
                         "as in serving, with generate-mode records)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--compiled", action="store_true", help="torch.compile the model (default: enforce_eager)")
    ap.add_argument("--profile", type=lambda s: s.split(","), default=[],
                    help="also cProfile these variants' steps (comma-separated)")
    ap.add_argument("--profile-top", type=int, default=40)
    ap.add_argument("--diff", type=lambda s: s.split(","), default=[],
                    help="variants whose per-function own time per step (cProfile) is printed against plain's, "
                         "largest excess first: where a variant's extra CPU per step goes, vLLM's frames included")
    ap.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS),
                    help="comma-separated capture_overhead variants, plain first (e.g. plain,floor,capture-eager)")
    a = ap.parse_args(argv)
    if a.variants[:1] != ["plain"] or any(v not in co.VARIANTS for v in a.variants):
        raise SystemExit(f"--variants must start with plain and name variants of {list(co.VARIANTS)}")
    co_argv = ["--hidden", str(a.hidden), "--head-dim", "32", "--num-layers", str(a.num_layers),
               "--prompt-len", str(a.prompt_len), "--prompts", str(a.prompts),
               "--batch-sizes", ",".join(map(str, a.inflight)), "--variants", ",".join(VARIANTS), "--no-hf",
               "--max-tokens", str(a.max_tokens)]
    if not a.compiled:
        co_argv.append("--eager")
    return a, co.parse_args(co_argv)


def child(variant: str, argv: list[str], conn) -> None:
    """One variant's engine in its own process (vLLM's KV-connector agent is a process global, so engines
    with and without a connector cannot share one process); serves the parent's commands."""
    a, args = parse(argv)
    model = co.build_model(args)
    data = co.prompts(args)
    runner = co.VARIANTS[variant](model, data, args)
    clock = StepClock(runner.engine())
    try:
        for b in a.inflight:  # warm-up (the first steps run the slot checks)
            runner.rate(b, data[: 2 * b + 8])
        conn.send("ready")
        while True:
            cmd, b = conn.recv()
            if cmd == "close":
                return
            if cmd == "rate":
                clock.reset()
                runner.rate(b)
                conn.send((clock.t / clock.n, clock.n))
            elif cmd == "count":
                counts, where = Counter(), Counter()
                clock.reset()
                clock.around = lambda: CountTorch(counts, where)
                runner.rate(b)
                clock.around = None
                conn.send((dict(counts), dict(where), clock.n))
            elif cmd == "profile":
                prof = cProfile.Profile()

                @contextmanager
                def profiled():
                    prof.enable()
                    try:
                        yield
                    finally:
                        prof.disable()

                clock.reset()
                clock.around = profiled
                for bb in a.inflight:
                    runner.rate(bb)
                clock.around = None
                if b == "raw":  # per-function (calls, own s, cumulative s) per step, for --diff
                    st = pstats.Stats(prof)
                    conn.send({f"{_short(fn)}:{line}({name})": (nc / clock.n, tt / clock.n, ct / clock.n)
                               for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items()})
                else:
                    conn.send(profile_text(prof, clock.n, a))
    finally:
        runner.close()


def _short(fn: str) -> str:
    return fn.split("/site-packages/")[-1].split("/work/main/")[-1]


def profile_text(prof, n1: int, a) -> str:
    st = pstats.Stats(prof)
    lines = [f"cProfile: {n1} steps ({'+'.join(map(str, a.inflight))} in flight); per step: calls, own us, cumulative us"]
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        if any(r in fn for r in ROOTS) or "connector" in name:
            rows.append((ct, nc, tt, f"{_short(fn)}:{line}({name})"))
    for ct, nc, tt, where in sorted(rows, reverse=True)[: a.profile_top]:
        lines.append(f"  {nc / n1:7.2f} {1e6 * tt / n1:9.1f} {1e6 * ct / n1:9.1f}  {where}")
    lines.append("  top cumulative overall:")
    top = sorted(((ct, nc, tt, f"{_short(fn)}:{line}({name})")
                  for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items()), reverse=True)[:30]
    for ct, nc, tt, where in top:
        lines.append(f"  {nc / n1:7.2f} {1e6 * tt / n1:9.1f} {1e6 * ct / n1:9.1f}  {where}")
    return "\n".join(lines)


def print_diff(plain: dict, var: dict, name: str, top: int) -> None:
    """Functions by how much more own time per step they take in ``name`` than in plain (cProfile, both
    engines over the same requests): where the variant's extra per-step CPU goes, vLLM's frames included."""
    keys = set(plain) | set(var)
    zero = (0.0, 0.0, 0.0)
    rows = sorted(((var.get(k, zero)[1] - plain.get(k, zero)[1], k) for k in keys), reverse=True)
    total = sum(d for d, _ in rows)
    print(f"\n{name} - plain, own time per step under cProfile (us; total {1e6 * total:+.0f}); calls per step plain -> {name}:")
    for d, k in rows[:top]:
        print(f"  {1e6 * d:+8.1f}  {plain.get(k, zero)[0]:6.1f} -> {var.get(k, zero)[0]:6.1f}  {k}")


def main() -> None:
    import multiprocessing as mp

    argv = sys.argv[1:]
    a, args = parse(argv)
    co.build_model(args)  # once, before the children look for it
    ctx = mp.get_context("spawn")
    conns, procs = {}, {}

    def recv(v):
        while not conns[v].poll(1.0):
            if not procs[v].is_alive():
                raise SystemExit(f"the {v} engine process died (exit {procs[v].exitcode})")
        return conns[v].recv()
    try:
        for v in a.variants:  # started one after the other: 2 cores
            parent, kid = ctx.Pipe()
            procs[v] = ctx.Process(target=child, args=(v, argv, kid), name=f"step-cost-{v}")
            procs[v].start()
            conns[v] = parent
            if recv(v) != "ready":
                raise SystemExit(f"{v} failed to start")
        per_step = {v: {b: [] for b in a.inflight} for v in a.variants}
        steps = {v: {b: [] for b in a.inflight} for v in a.variants}
        for rnd in range(a.rounds):
            for b in a.inflight:
                k = (rnd + a.inflight.index(b)) % len(a.variants)
                for v in a.variants[k:] + a.variants[:k]:
                    conns[v].send(("rate", b))
                    t, n = recv(v)
                    per_step[v][b].append(t)
                    steps[v][b].append(n)
        print(f"\nper-step wall time of LLMEngine.step(), in-process engine core, CPU build "
              f"(vLLM {__import__('vllm').__version__}), tiny qwen3 hidden {a.hidden} x {a.num_layers} layers, "
              f"{'compiled' if a.compiled else 'eager'}, {a.prompts} x {a.prompt_len}-token prompts, max_tokens {a.max_tokens}, "
              f"{a.rounds} interleaved rounds; median [min-max]; ratio = variant / plain in the same round")
        print(f"{'in-flight':>9} {'variant':>14} {'us/step':>9} {'range':>17} {'steps':>6} {'ratio':>6} {'ratio range':>13} "
              f"{'+us/step':>9}")
        for b in a.inflight:
            plain = per_step["plain"][b]
            for v in a.variants:
                xs = per_step[v][b]
                ratios = [x / p for x, p in zip(xs, plain)]
                extra = statistics.median([x - p for x, p in zip(xs, plain)])
                print(f"{b:>9} {v:>14} {1e6 * statistics.median(xs):>9.0f} "
                      f"{f'[{1e6 * min(xs):.0f}-{1e6 * max(xs):.0f}]':>17} {statistics.median(steps[v][b]):>6.0f} "
                      f"{statistics.median(ratios):>6.3f} {f'[{min(ratios):.3f}-{max(ratios):.3f}]':>13} "
                      f"{1e6 * extra:>9.0f}")
        for b in a.inflight:
            print(f"\ntorch calls per step (Python-level torch functions / tensor methods in the stepping thread), "
                  f"{b} in flight:")
            wheres = {}
            for v in a.variants:
                conns[v].send(("count", b))
                counts, where, n0 = recv(v)
                wheres[v] = (where, n0)
                print(f"  {v:>14}: {counts.get('all', 0) / n0:7.1f} per step in all, "
                      f"{counts.get('layertap+connector', 0) / n0:6.1f} called from layertap / vLLM KV-connector code, "
                      f"{counts.get('layertap+connector ops', 0) / n0:6.1f} of them ops (not attribute reads) ({n0} steps)")
            for v in a.variants[1:]:
                where, n0 = wheres[v]
                print(f"  {v} by innermost layertap / connector frame -> torch call, per step:")
                for key, c in sorted(where.items(), key=lambda kv: -kv[1]):
                    print(f"    {c / n0:6.2f}  {key}")
        for v in a.profile:
            conns[v].send(("profile", 0))
            print(f"\n{v}: " + recv(v))
        if a.diff:
            raw = {}
            for v in ["plain"] + [x for x in a.diff if x != "plain"]:
                conns[v].send(("profile", "raw"))
                raw[v] = recv(v)
            for v in [x for x in a.diff if x != "plain"]:
                print_diff(raw["plain"], raw[v], v, a.profile_top)
    finally:
        for v, c in conns.items():
            try:
                c.send(("close", 0))
            except OSError:
                pass
        for p in procs.values():
            p.join(timeout=120)


if __name__ == "__main__":
    main()
