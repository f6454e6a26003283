"""Loopback helpers shared by the tests that start real servers (Mooncake master, vLLM's server, Ray)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextmanager
def mooncake_master(timeout: float = 20.0) -> Iterator[tuple[str, subprocess.Popen, tuple[int, int]]]:
    """A real ``mooncake_master`` bound to 127.0.0.1 (its defaults bind 0.0.0.0); killed on exit.
    Yields (address, process, (rpc port, metrics port)) once it listens."""
    exe = shutil.which("mooncake_master") or str(Path(sys.executable).parent / "mooncake_master")
    rpc, metrics = free_port(), free_port()
    proc = subprocess.Popen([exe, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--metrics_host=127.0.0.1",
                             f"--metrics_port={metrics}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while not listening(rpc):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mooncake_master did not listen on 127.0.0.1:{rpc} (exit {proc.poll()})")
            time.sleep(0.1)
        yield f"127.0.0.1:{rpc}", proc, (rpc, metrics)
    finally:
        proc.kill()
        proc.wait(10)
