import time, statistics, sys, numpy as np, torch
sys.path.insert(0, ".")  # run from the tree measured
from layertap.transport.base import get_transport
from layertap.records import layout, LAYER_SEMANTICS, token_digest, MetaTemplate
tr = get_transport("shm")
cfg = {**tr.prepare({"slot_mb": 17, "slots": 64, "checksum": "none"}), "backend": "shm"}
src, sink = tr.make_source(cfg), tr.make_sink(cfg, "w")
region_np = sink.data_region().numpy()
ids = np.arange(1024, dtype=np.int64)
shared = {"layer_ids": [1, 8, 13, 16], "layer_semantics": LAYER_SEMANTICS, "cache_group": {"index": 1, "block_size": 16, "num_groups": 2, "own_group": True, "group_types": ["FullAttentionSpec", "HiddenStateCacheSpec"]},
          "dtype": "bfloat16", "model": "/tmp/x", "vllm": "0.32.0"}
t = MetaTemplate(shared)
per = {"key": "run:r-1", "request_id": "r-1", "index": 3, "mode": "prompt", "num_tokens": 1024,
        "num_prompt_tokens": 1024, "token_digest": token_digest(ids), "next_token_id": None, "run": "run", "loss_spans": None}
specs = {"token_ids": (torch.int64, (1024,)), "hidden_states": (torch.bfloat16, (1024, 4, 2048))}
import cProfile, pstats
T = []
for i in range(3000):
    t0 = time.perf_counter(); res = sink.reserve(f"k{i}", specs, per, template=t, device_commit=True, views=False); T.append(time.perf_counter() - t0); res.abort()
print("reserve median us", round(statistics.median(T[200:]) * 1e6, 1))
pr = cProfile.Profile(); pr.enable()
for i in range(3000):
    res = sink.reserve(f"k{i}", specs, per, template=t, device_commit=True, views=False); res.abort()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(14)
sink.close(); src.close(); tr.cleanup(cfg)
