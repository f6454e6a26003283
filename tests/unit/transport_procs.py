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


def _tree(root: int) -> set[int]:
    """``root`` and every living process below it."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                parent[int(d)] = int(Path(f"/proc/{d}/stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _in_use_elsewhere(names: set[str]) -> set[str]:
    """Those of ``names`` that a living process outside this process's tree has mapped or open: another
    run's segments (a second test suite, an engine beside us), never ours to count as leaked."""
    if not names:
        return set()
    ours, found = _tree(os.getpid()), set()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in ours:
            continue
        try:
            refs = Path(f"/proc/{d}/maps").read_text()
            refs += " ".join(os.readlink(f"/proc/{d}/fd/{fd}") for fd in os.listdir(f"/proc/{d}/fd"))
        except OSError:
            continue
        found |= {n for n in names if f"/dev/shm/{n}" in refs}
    return found


def shm_entries(prefix: str = "layertap-") -> set[str]:
    """Segments in /dev/shm, minus those another run on this machine is using (another suite or engine
    creates its own while we run: those are not ours, and must neither fail nor pass a leak check)."""
    names = {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    return names - _in_use_elsewhere(names)


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


def take(src: Any, n: int, timeout: float = 30.0) -> dict:
    """Poll ``src`` until ``n`` records arrived (by key), or fail the test naming how many did."""
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        for rec in src.poll(0.2):
            got[rec.key] = rec
    assert len(got) == n, f"{len(got)} of {n} records arrived"
    return got


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HERE), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


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


def _device_reserve(name: str, cfg: dict[str, Any], writer: str, count: int, raw: bool = False) -> None:
    """Plays the engine on CUDA with device commits: reserve ``count`` records for a device commit, write
    their payloads, hand them to the "device", then land each one's commit word (what the copy engine
    does after the payload) when stdin says ``land <i>``; ``exit`` ends it. ``raw``: as the lean record
    path does, reserve byte offsets (``views=False``) and write every byte through them into the mapping."""
    sink = get_transport(name).make_sink(cfg, writer)
    region = sink.data_region().numpy()
    word = sink.commit_word()
    pending = []
    for i in range(count):
        key, tensors, meta = make_record(i)
        res = sink.reserve(key, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, meta, device_commit=True,
                           views=not raw)
        if raw:
            assert not res.tensors and res.commit_target is None
            for k, t in tensors.items():
                b = t.contiguous().view(-1).view(torch.uint8).numpy()
                region[res.offsets[k]:res.offsets[k] + b.size] = b
            target = torch.from_numpy(region[res.state_at:res.state_at + 4]).view(torch.int32)
        else:
            for k, t in tensors.items():
                res.tensors[k].copy_(t)
            target = res.commit_target
        res.handed_to_device()
        pending.append(target)
    sink.wake_consumer()  # once for the batch, as the engine does after queuing a group's copies
    print("reserved", flush=True)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "land":
            pending[int(arg[0])].copy_(word)
            print("landed", flush=True)
        elif cmd == "exit":
            break
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
        elif cmd == "device-reserve":
            _device_reserve(name, cfg, argv[3], int(argv[4]), raw=len(argv) > 5 and argv[5] == "raw")
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
