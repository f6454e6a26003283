"""Producer / consumer processes for the transport tests, and small shared helpers.

Run as a script in a child process::

    python transport_procs.py produce <transport> <config-json> <writer> <first> <count> <tokens>
    python transport_procs.py consume <transport> <config-json> [<delay-s>]

``produce`` prints ``ready`` once its sink exists, then one JSON summary line (or ``ERROR <type> <msg>``
and exit 3); ``count`` < 0 means put forever. ``consume`` prepares the transport itself (it owns the
pool), prints the prepared config as one JSON line, then prints each received key and releases it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from layertap.records import token_digest  # noqa: E402
from layertap.transport.base import get_transport  # noqa: E402

HERE = Path(__file__).resolve()


def make_record(i: int, tokens: int = 16, layers: int = 2, hidden: int = 8,
                key: str | None = None) -> tuple[str, dict[str, torch.Tensor], dict[str, Any]]:
    """A deterministic record (values depend on ``i``) with a correct token digest."""
    g = torch.Generator().manual_seed(i)
    ids = torch.randint(0, 1000, (tokens,), generator=g)
    hs = torch.randn(tokens, layers, hidden, generator=g)
    key = key or f"req-{i}"
    meta = {"index": i, "key": key, "layer_ids": list(range(layers)), "num_prompt_tokens": tokens,
            "token_digest": token_digest(ids)}
    return key, {"token_ids": ids, "hidden_states": hs}, meta


def expected_hidden(i: int, tokens: int = 16, layers: int = 2, hidden: int = 8) -> torch.Tensor:
    return make_record(i, tokens, layers, hidden)[1]["hidden_states"]


def shm_entries(prefix: str = "layertap-") -> set[str]:
    """Our segments in /dev/shm (other engineers' engines create their own; those are not ours)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``pred`` until truthy; raise ``TimeoutError`` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def read_line(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    """Next stdout line of ``proc`` within ``timeout`` s (raises with its stderr if it exits first)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        raise TimeoutError(f"no output from pid {proc.pid} within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"pid {proc.pid} exited {proc.wait()}: {proc.stderr.read()[-2000:]}")
    return line.strip()


def _produce(name: str, cfg: dict[str, Any], writer: str, first: int, count: int, tokens: int) -> None:
    sink = get_transport(name).make_sink(cfg, writer)
    print("ready", flush=True)
    i = first
    while count < 0 or i < first + count:
        sink.put(*make_record(i, tokens))
        i += 1
    sink.flush()
    print(json.dumps({"done": i - first, "waits": getattr(sink, "waits", 0)}), flush=True)
    sink.close()


def _consume(name: str, cfg: dict[str, Any], delay: float) -> None:
    t = get_transport(name)
    cfg = t.prepare(cfg)
    print(json.dumps(cfg), flush=True)
    src = t.make_source(cfg)
    while True:
        for rec in src.poll(0.5):
            print(rec.key, flush=True)
            rec.release()
            time.sleep(delay)  # simulates a slow consumer (not synchronization)


def main(argv: list[str]) -> int:
    cmd, name, cfg = argv[0], argv[1], json.loads(argv[2])
    try:
        if cmd == "produce":
            _produce(name, cfg, argv[3], int(argv[4]), int(argv[5]), int(argv[6]))
        elif cmd == "consume":
            _consume(name, cfg, float(argv[3]) if len(argv) > 3 else 0.0)
        else:
            raise SystemExit(f"unknown command {cmd}")
    except Exception as e:  # report to the parent test, which asserts on it
        print(f"ERROR {type(e).__name__} {e}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
