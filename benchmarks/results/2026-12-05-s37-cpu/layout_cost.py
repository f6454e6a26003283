import sys, json, timeit, torch, numpy as np
sys.path.insert(0, sys.argv[1])
from layertap import records as R
ids = np.arange(1024, dtype=np.int64)
meta = {"key": "run:r-1", "request_id": "r-1", "index": 3, "mode": "prompt", "layer_ids": [1, 8, 13, 16], "num_tokens": 1024,
        "num_prompt_tokens": 1024, "token_digest": R.token_digest(ids), "layer_semantics": R.LAYER_SEMANTICS, "next_token_id": None,
        "cache_group": {"index": 1, "block_size": 16, "num_groups": 2, "own_group": True, "group_types": ["FullAttentionSpec", "HiddenStateCacheSpec"]},
        "run": "run", "loss_spans": None, "dtype": "bfloat16", "model": "/tmp/x", "vllm": "0.32.0"}
specs = {"token_ids": (torch.int64, (1024,)), "hidden_states": (torch.bfloat16, (1024, 4, 2048))}
n=20000
print("layout full", round(min(timeit.repeat(lambda: R.layout(specs, meta), number=n, repeat=3)) / n * 1e6, 2), "us")
if hasattr(R, "MetaTemplate"):
    const = {k: meta[k] for k in ("layer_ids", "layer_semantics", "cache_group", "dtype", "model", "vllm")}
    per = {k: v for k, v in meta.items() if k not in const}
    t = R.MetaTemplate(const)
    assert R.layout(specs, per, template=t) == R.layout(specs, meta)
    print("layout tmpl", round(min(timeit.repeat(lambda: R.layout(specs, per, template=t), number=n, repeat=3)) / n * 1e6, 2), "us")
    k = [0]
    def miss():
        k[0] += 1; r = 100 + k[0] % 5000
        return R.layout({"token_ids": (torch.int64, (r,)), "hidden_states": (torch.bfloat16, (r, 4, 2048))}, per, template=t)
    print("layout tmpl, shape miss", round(min(timeit.repeat(miss, number=n, repeat=3)) / n * 1e6, 2), "us")
