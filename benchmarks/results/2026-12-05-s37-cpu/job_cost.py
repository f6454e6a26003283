"""SchedulerSide._job per record (the token list's conversion, its digest, the manifest), one tree."""
import sys, timeit, statistics
from types import SimpleNamespace as NS
from layertap.engine.saves import SchedulerSide
import layertap.engine.saves as S
print(S.__file__, file=sys.stderr)
c = NS(_layer_ids=[1, 8, 13, 16], _group_desc={"index": 1, "block_size": 16, "num_groups": 2, "own_group": True,
       "group_types": ["FullAttentionSpec", "HiddenStateCacheSpec"]}, _group=0, _check_steps=0, _extra={"capture_path": "hook"})
s = SchedulerSide(c)
ids = list(range(100000, 100000 + int(sys.argv[1])))
f = lambda: s._job("r-1", {"index": 3, "run": "bench"}, "prompt", ids, len(ids), None, [1, 2, 3])
n = 2000
print(round(min(timeit.repeat(f, number=n, repeat=7)) / n * 1e6, 1))
