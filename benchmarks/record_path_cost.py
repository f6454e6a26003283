"""What the record path costs the engine's step thread, without an engine: layertap's real worker code
(``WorkerSide.finished`` -> gather, transport reservations, host copies, device commits) on a cache view
shaped like the GPU benchmark's capture layer, writing into a real shm pool (page-locked on CUDA, as in the
engine), driven step by step with ``records`` finished records per step.

It answers one question the engine runs cannot: of the worker's per-step time (``layertap's per-step work``
in the engine log, 0.29 ms per step on the H200 at 1 in flight, 2026-12-03), how much is this code itself,
and in which phase (``record_writer.PHASES``), with nothing else in the process competing for the GIL. With
``--busy-ms`` a matmul of about that length is queued on the forward stream before every step, so the
gather waits on it and every CUDA call is made against a busy GPU, as in the engine.

    python benchmarks/record_path_cost.py                                     # CPU: a small view, smoke run
    python benchmarks/record_path_cost.py --hidden 2048 --rows 1024 --records 1,8 --busy-ms 0,5   # GPU

Prints per configuration the median step time on the step thread, per record, and the phases; between
steps (untimed) the copies are waited for and the records taken off the pool and proven by token digest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stand_in_for_vllm() -> None:
    """The record path needs no engine, and a bare GPU host may have no vLLM: ``saves`` subclasses one vLLM
    class (the connector metadata base), so where vLLM is missing a plain class stands in for it."""
    import importlib.util
    import types

    try:
        if importlib.util.find_spec("vllm") is not None:
            return
    except (ImportError, ValueError):
        pass
    parts = "vllm.distributed.kv_transfer.kv_connector.v1.base".split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    sys.modules["vllm.distributed.kv_transfer.kv_connector.v1.base"].KVConnectorMetadata = type("KVConnectorMetadata", (), {})


_stand_in_for_vllm()

from layertap.engine import record_writer as rw  # noqa: E402
from layertap.engine.saves import LayertapMetadata  # noqa: E402
from layertap.records import LAYER_SEMANTICS, token_digest  # noqa: E402
from layertap.transport.shm import ShmTransport  # noqa: E402


def make_worker(view: torch.Tensor, hidden: int, block_size: int, tcfg: dict, layer_ids: list[int],
                options: dict | None = None):
    """A ``WorkerSide`` as the connector's ``register`` leaves it (the view attached, the transport open),
    built from stand-ins for the connector and vLLM's config: no engine. ``options``: connector options
    (e.g. ``{"lean": False}``: the torch record path)."""
    c = SimpleNamespace(_block_size=block_size, _layer_ids=layer_ids, _extra={**(options or {}),
        "transport": {**tcfg, "backend": "shm"},
        "run_meta": {"model": "/tmp/bench", "config_hash": "0" * 16, "vllm_version": "none",
                     "layer_semantics": LAYER_SEMANTICS, "num_hidden_layers": 16, "hidden_size": hidden,
                     "format_version": 1}})
    model = SimpleNamespace(get_hidden_size=lambda: hidden, get_total_num_hidden_layers=lambda: 16)
    w = rw.WorkerSide(c, SimpleNamespace(model_config=model))
    w.attach("bench", view, plane_axis=2)
    w.open_transport()
    return w


def jobs_for(step: int, records: int, rows: int, block_size: int, num_blocks: int, rng: np.random.Generator,
             sched: Any = None):
    """One step's finished records, made by the connector's own scheduler side (``SchedulerSide._job``: the
    record's own manifest fields and the shared ones, as the engine hands them to the worker)."""
    need = -(-rows // block_size)
    out = []
    for r in range(records):
        blocks = rng.choice(np.arange(1, num_blocks), size=need, replace=False).tolist()
        ids = rng.integers(0, 2048, size=rows, dtype=np.int64).tolist()
        out.append(sched._job(f"{step}-{r}", {"index": step * records + r, "run": "bench"}, "prompt", ids, rows, None,
                              blocks))
    return out


def scheduler_side(layer_ids: list[int], block_size: int) -> Any:
    from layertap.engine.saves import SchedulerSide

    group = {"index": 0, "block_size": block_size, "num_groups": 1, "own_group": False, "group_types": ["bench"]}
    return SchedulerSide(SimpleNamespace(_layer_ids=layer_ids, _group_desc=group, _group=0, _check_steps=0,
                                         _extra={"capture_path": "hook"}))


def run_config(args, records: int, busy_ms: float, dev: str) -> dict:
    n_planes, block = args.planes, 16
    rec_bytes = args.rows * n_planes * args.hidden * 2 + args.rows * 9 + 4096
    num_blocks = max(4 * records * -(-args.rows // block) + 2, 64)
    view = torch.randn(num_blocks, block, n_planes, args.hidden, device=dev).to(torch.bfloat16)
    cfg = ShmTransport.prepare({"slot_bytes": rec_bytes, "num_slots": 2 * records + 2, "checksum": "none"})
    src = ShmTransport.make_source(cfg)
    w = make_worker(view, args.hidden, block, cfg, [1, 2, 3, 4], json.loads(args.options))
    load = None
    if dev == "cuda" and busy_ms > 0:  # a matmul of about busy_ms on the forward stream before each step
        n = 4096
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        reps = max(1, round(busy_ms / (1e3 * (time.perf_counter() - t0) / 10)))
        load = (a, reps)
    rng = np.random.default_rng(records)
    sched = scheduler_side([1, 2, 3, 4], block)
    steps, per_phase = [], []
    try:
        for step in range(args.warmup + args.iters):
            jobs = jobs_for(step, records, args.rows, block, num_blocks, rng, sched)
            if load is not None:
                for _ in range(load[1]):
                    load[0] @ load[0]
            before = dict(w.phase_s)
            t0 = time.perf_counter()
            done = w.finished(LayertapMetadata(saves=jobs))
            dt = time.perf_counter() - t0
            assert done == {j.req_id for j in jobs}, done
            if step >= args.warmup:
                steps.append(dt)
                per_phase.append({k: w.phase_s[k] - before[k] for k in rw.PHASES})
            if dev == "cuda":  # untimed: the copies land, the records are taken off and proven
                torch.cuda.synchronize()
            got = 0
            deadline = time.monotonic() + 30
            while got < records:
                for rec in src.poll(0.5):
                    want = next(j for j in jobs if j.key == rec.key)
                    if token_digest(rec.token_ids.numpy()) != token_digest(want.token_ids):
                        raise SystemExit(f"record {rec.key}: token digest mismatch")
                    got += 1
                    rec.release()
                if time.monotonic() > deadline:
                    raise SystemExit(f"step {step}: {got} of {records} records arrived")
            with w.staging:
                w._reap()
    finally:
        w.close()
        src.close()
    med = statistics.median(steps)
    return {"records": records, "busy_ms": busy_ms, "step_us": 1e6 * med, "per_record_us": 1e6 * med / records,
            "phases_per_record_us": {k: 1e6 * statistics.median(p[k] for p in per_phase) / records for k in rw.PHASES},
            "rounds": len(steps)}


def pair(args, argv: list[str]) -> list[dict]:
    """This tree against ``--baseline-tree``, each in its own child process per round, alternating (the
    order flips every round); the ratio of the median step times per configuration, with its range."""
    import subprocess
    import tempfile

    skip = {"--baseline-tree", "--rounds", "--json", "--baseline-options", "--options"}
    child, i = [], 0
    while i < len(argv):  # this run's own flags, less the pairing ones
        flag = argv[i].split("=", 1)[0]
        if flag in skip:
            i += 1 if "=" in argv[i] else 2
            continue
        child.append(argv[i])
        i += 1
    trees = {"this": Path(__file__).resolve().parents[1], "baseline": Path(args.baseline_tree).resolve()}
    opts = {"this": args.options, "baseline": args.baseline_options or args.options}
    got: dict[str, list[list[dict]]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in (list(trees) if rnd % 2 == 0 else list(trees)[::-1]):
                out = Path(tmp) / f"{name}-{rnd}.json"
                r = subprocess.run([sys.executable, str(trees[name] / "benchmarks" / "record_path_cost.py"), *child,
                                    *(["--options", opts[name]] if opts[name] != "{}" else []), "--json", str(out)],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise SystemExit(f"{name} ({trees[name]}) failed:\n{r.stderr[-3000:]}")
                got[name].append(json.loads(out.read_text())["rows"])
                print(f"round {rnd + 1} {name}: " + ", ".join(f"{x['records']} rec / busy {x['busy_ms']:g} ms "
                                                             f"{x['step_us']:.0f} us" for x in got[name][-1]), flush=True)
    rows = []
    print(f"\n{'records':>7} {'GPU busy ms':>11} {'this us':>9} {'baseline us':>11}   this / baseline [min-max]")
    for j, cfg in enumerate(got["this"][0]):
        ratios = [a[j]["step_us"] / b[j]["step_us"] for a, b in zip(got["this"], got["baseline"])]
        this = statistics.median(r[j]["step_us"] for r in got["this"])
        base = statistics.median(r[j]["step_us"] for r in got["baseline"])
        rows.append({"records": cfg["records"], "busy_ms": cfg["busy_ms"], "this_step_us": this, "baseline_step_us": base,
                     "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]})
        print(f"{cfg['records']:>7} {cfg['busy_ms']:>11.1f} {this:>9.1f} {base:>11.1f}   "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"pair": rows, "rounds": got, "baseline_tree": str(trees["baseline"]),
                                               "options": opts}, indent=1))
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=None, help="default 2048 on CUDA, 64 on the CPU")
    ap.add_argument("--rows", type=int, default=None, help="rows per record (default 1024 on CUDA, 64 on the CPU)")
    ap.add_argument("--planes", type=int, default=4)
    ap.add_argument("--records", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8])
    ap.add_argument("--busy-ms", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 5.0],
                    help="GPU work queued on the forward stream before each step (CUDA only)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--breakdown", action="store_true", help="CUDA: time each call of the gather and the copies")
    ap.add_argument("--baseline-tree", default=None,
                    help="another layertap checkout (with this script): both run in turn, --rounds times each, "
                         "in child processes; prints the step time of each and the ratio this / baseline")
    ap.add_argument("--rounds", type=int, default=3, help="--baseline-tree: interleaved rounds (default 3)")
    ap.add_argument("--options", default="{}", help='connector options as JSON, e.g. \'{"lean": false}\'')
    ap.add_argument("--baseline-options", default=None,
                    help="--baseline-tree: the baseline's connector options (default: --options); with "
                         "--baseline-tree . this pairs two options of one checkout")
    args = ap.parse_args(argv)
    if args.baseline_tree:
        return pair(args, argv if argv is not None else sys.argv[1:])
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.breakdown and dev == "cuda":
        for k, v in breakdown().items():
            print(f"{k:<36} {v:8.1f} us", flush=True)
    args.hidden = args.hidden or (2048 if dev == "cuda" else 64)
    args.rows = args.rows or (1024 if dev == "cuda" else 64)
    busy = args.busy_ms if dev == "cuda" else [0.0]
    print(f"record path on {dev}: {args.rows} rows x {args.planes} planes x {args.hidden} per record, "
          f"{args.iters} steps per configuration (medians)", flush=True)
    print(f"{'records':>7} {'GPU busy ms':>11} {'step us':>9} {'per record us':>13}   phases per record (us)")
    out = []
    for b in busy:
        for k in args.records:
            r = run_config(args, k, b, dev)
            out.append(r)
            print(f"{k:>7} {b:>11.1f} {r['step_us']:>9.1f} {r['per_record_us']:>13.1f}   "
                  + ", ".join(f"{p} {v:.1f}" for p, v in r["phases_per_record_us"].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": dev, "args": vars(args), "rows": out}, indent=1))
    return out



def breakdown(iters: int = 200, rows: int = 1024, hidden: int = 2048, planes: int = 4) -> dict[str, float]:
    """CUDA only: the median time of each call the gather and the copies make (and of the alternatives a
    leaner path could take), one record of ``rows`` rows per step; microseconds on the calling thread."""
    from layertap.engine.cache_view import gather_blocks, view_geometry

    dev = torch.device("cuda")
    view = torch.randn(256, 16, planes, hidden, device=dev).to(torch.bfloat16)
    geo = view_geometry(tuple(view.shape), planes, hidden, plane_axis=2)
    blocks = list(range(1, 1 + rows // 16))
    host = torch.empty(rows, planes, hidden, dtype=torch.bfloat16).pin_memory()
    word_host = torch.zeros(1, dtype=torch.int32).pin_memory()
    word = torch.ones(1, dtype=torch.int32, device=dev)
    side, copy = torch.cuda.Stream(), torch.cuda.Stream()
    fwd = torch.cuda.current_stream()
    ring = torch.empty(4096, dtype=torch.int64).pin_memory()
    ev_pool = [torch.cuda.Event() for _ in range(4)]
    t: dict[str, list[float]] = {}

    def lap(name: str, t0: float) -> float:
        now = time.perf_counter()
        t.setdefault(name, []).append(now - t0)
        return now

    for i in range(iters + 20):
        torch.cuda.synchronize()
        if i == 20:
            t.clear()
        c = time.perf_counter()
        ready = torch.cuda.Event()
        c = lap("Event()", c)
        ready.record(fwd)
        c = lap("event.record", c)
        side.wait_event(ready)
        c = lap("stream.wait_event", c)
        cpu_idx = torch.tensor(blocks, dtype=torch.int64)
        c = lap("torch.tensor(list)", c)
        pinned = cpu_idx.pin_memory()
        c = lap("pin_memory()", c)
        with torch.cuda.stream(side):
            c = lap("enter stream ctx", c)
            dev_idx = pinned.to(dev, non_blocking=True)
            c = lap("H2D index (pinned)", c)
            rows_t = gather_blocks(view, geo, dev_idx)
            c = lap("gather kernel (view[idx])", c)
        c = lap("exit stream ctx", c)
        ring[: len(blocks)].numpy()[:] = blocks
        c = lap("alt: fill a pinned ring (numpy)", c)
        with torch.cuda.stream(side):
            ring[: len(blocks)].to(dev, non_blocking=True)
        c = lap("alt: H2D from the ring", c)
        torch.index_select(view, 0, dev_idx)
        c = lap("alt: index_select kernel", c)
        ev_pool[i % 4].record(side)
        c = lap("alt: record a pooled event", c)
        fwd.wait_event(ev_pool[i % 4])
        c = lap("stream.wait_event (fwd)", c)
        copy.wait_event(ev_pool[i % 4])
        c = time.perf_counter()
        with torch.cuda.stream(copy):
            host.copy_(rows_t[:rows], non_blocking=True)
            c = lap("D2H payload copy_", c)
            word_host.copy_(word, non_blocking=True)
            c = lap("D2H commit word copy_", c)
        done = torch.cuda.Event(blocking=True)
        done.record(copy)
        c = lap("Event(blocking) + record", c)
        rows_t.record_stream(copy)
        c = lap("record_stream", c)
    torch.cuda.synchronize()
    return {k: 1e6 * statistics.median(v) for k, v in t.items()}


if __name__ == "__main__":
    main()
