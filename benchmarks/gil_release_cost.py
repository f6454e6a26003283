"""What a call that lets go of the GIL costs a thread when another thread of its process has Python to run.

The engine's step thread and the driver's loop share their processes with vLLM's own threads (the engine
core's input and output sockets, the client's output queue), which at times decode or encode messages. A call
that releases the GIL (hashlib on 2048 bytes or more, every torch op, numpy copies of a few hundred elements
or more) must get it back afterwards, and the thread holding it lets go only when it blocks or at the end of a
switch interval (``sys.getswitchinterval()``, 5 ms by default). This prints, for each call, its median and mean
time alone and beside one busy thread, in one process, and the ratio of the sha256 of a 1024-token record's
ids fed whole (releases the GIL) to the same digest fed in pieces that keep it (``records.sha256_hex``).

Run it on an otherwise idle machine: the hand-off costs a switch interval only while the busy thread has a
core to run on (on this 2-core box under the test suite's load the busy thread seldom ran, and no call was
slowed). On CUDA it also times the lean record path's calls (events, stream waits, the gather, record_stream).

    python benchmarks/gil_release_cost.py [CALLS]
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time(f, n: int) -> tuple[float, float]:
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
        sum(range(200))  # a little Python between calls, as on a step
    return statistics.median(t) * 1e6, statistics.mean(t) * 1e6


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    from layertap.records import sha256_hex

    n = int((argv or sys.argv[1:] or ["200"])[0])
    raw = np.arange(1024, dtype="<i8").tobytes()
    src, dst = np.arange(1024, dtype=np.int64), np.empty(1024, dtype=np.int64)
    calls = {
        "sha256 of 8 KiB, whole (releases)": lambda: hashlib.sha256(raw).hexdigest(),
        "sha256 of 8 KiB, sha256_hex (keeps)": lambda: sha256_hex(raw),
        "numpy copy of 1024 int64": lambda: dst.__setitem__(slice(None), src),
        "torch.empty(1)": lambda: torch.empty(1),
    }
    if torch.cuda.is_available():  # the lean record path's calls on the engine's step thread
        dev = torch.device("cuda")
        view = torch.zeros(256, 16, 4, 256, device=dev, dtype=torch.bfloat16)
        idx = torch.arange(64, device=dev)
        side = torch.cuda.Stream()
        ev = torch.cuda.Event()
        rows = torch.index_select(view, 0, idx)
        calls.update({
            "torch.cuda.Event()": lambda: torch.cuda.Event(),
            "event.record()": lambda: ev.record(),
            "stream.wait_event": lambda: side.wait_event(ev),
            "event.query()": lambda: ev.query(),
            "index_select on the device": lambda: torch.index_select(view, 0, idx),
            "tensor.record_stream": lambda: rows.record_stream(side),
            "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        })
    assert hashlib.sha256(raw).hexdigest() == sha256_hex(raw)
    alone = {k: _time(f, n) for k, f in calls.items()}
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    th = threading.Thread(target=busy, daemon=True)
    th.start()
    try:
        beside = {k: _time(f, n) for k, f in calls.items()}
    finally:
        stop.set()
        th.join()
    print(f"us per call, median / mean over {n} (switch interval {sys.getswitchinterval() * 1e3:.0f} ms)")
    print(f"{'call':<40}{'alone':>18}{'beside a busy thread':>24}")
    for k in calls:
        print(f"{k:<40}{alone[k][0]:>9.1f} /{alone[k][1]:>7.1f}{beside[k][0]:>13.1f} /{beside[k][1]:>9.1f}")
    whole, kept = beside["sha256 of 8 KiB, whole (releases)"][1], beside["sha256 of 8 KiB, sha256_hex (keeps)"][1]
    print(f"beside a busy thread, mean: sha256_hex / whole = {kept / whole:.4f}")
    return {"alone": {k: v[1] for k, v in alone.items()}, "beside": {k: v[1] for k, v in beside.items()}}


if __name__ == "__main__":
    main()
