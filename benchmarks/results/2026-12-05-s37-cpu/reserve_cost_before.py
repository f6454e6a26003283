import time, statistics, sys, numpy as np, torch
sys.path.insert(0, ".")  # run from the tree measured
from layertap.transport.base import get_transport
from layertap.records import layout, LAYER_SEMANTICS, token_digest
tr = get_transport("shm")
cfg = {**tr.prepare({"slot_mb": 17, "slots": 16, "checksum": "none"}), "backend": "shm"}
src, sink = tr.make_source(cfg), tr.make_sink(cfg, "w")
region_np = sink.data_region().numpy()
ids = np.arange(1024, dtype=np.int64)
meta = {"key": "run:r-1", "request_id": "r-1", "index": 3, "mode": "prompt", "layer_ids": [1, 8, 13, 16], "num_tokens": 1024,
        "num_prompt_tokens": 1024, "token_digest": token_digest(ids), "layer_semantics": LAYER_SEMANTICS, "next_token_id": None,
        "cache_group": {"index": 1, "block_size": 16, "num_groups": 2, "own_group": True, "group_types": ["FullAttentionSpec", "HiddenStateCacheSpec"]},
        "run": "run", "loss_spans": None, "dtype": "bfloat16", "model": "/tmp/x", "vllm": "0.32.0"}
specs = {"token_ids": (torch.int64, (1024,)), "hidden_states": (torch.bfloat16, (1024, 4, 2048))}
T = {"layout": [], "reserve": [], "fill": [], "abort": []}
for i in range(3000):
    t0 = time.perf_counter(); layout(specs, meta); t1 = time.perf_counter()
    res = sink.reserve(f"k{i}", specs, meta, device_commit=True, views=False); t2 = time.perf_counter()
    o = res.offsets["token_ids"]; region_np[o:o + 8 * 1024].view(np.int64)[:] = ids; t3 = time.perf_counter()
    res.abort(); t4 = time.perf_counter()
    if i > 200:
        for k, d in zip(T, (t1-t0, t2-t1, t3-t2, t4-t3)): T[k].append(d*1e6)
print({k: round(statistics.median(v), 1) for k, v in T.items()})
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for i in range(3000):
    res = sink.reserve(f"k{i}", specs, meta, device_commit=True, views=False); res.abort()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(15)
sink.close(); src.close(); tr.cleanup(cfg)
