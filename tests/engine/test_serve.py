"""``layertap serve`` on a free loopback port: one completion opts in to capture, one does not; exactly
one record arrives, in generate mode (prompt + answer), and it is the opted-in request's tokens."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from layertap.models.train_target import trained_target
from layertap.records import token_digest
from layertap.transport.file import load_records

from tests.netutil import free_port

pytestmark = pytest.mark.engine


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before it was ready")
        try:
            if requests.get(url + "/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"server not ready within {timeout:.0f}s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("served") / "ds"
    port = free_port()
    log = open(out.parent / "serve.log", "w")
    cmd = [sys.executable, "-m", "layertap", "serve", "--model", str(trained_target()), "--layers", "1,2,3,4",
           "--out", str(out), "--port", str(port), "--max-model-len", "1024", "--enforce-eager",
           "--kv-cache-memory-bytes", str(64 << 20)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, 180)
        yield url, out
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _complete(url: str, prompt: str, capture: bool) -> dict:
    body = {"model": str(trained_target()), "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
            "return_token_ids": True}
    if capture:
        body["kv_transfer_params"] = {"layertap": {}}
    r = requests.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_only_the_opted_in_request_is_captured(server):
    url, out = server
    plain = _complete(url, "def add(a, b):\n", capture=False)
    captured = _complete(url, "import os\nimport sys\n", capture=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(load_records(out)) < 1:
        time.sleep(0.2)
    time.sleep(1.0)  # a second record, if one were wrongly written, would have landed by now
    ds = load_records(out)
    assert len(ds) == 1, f"{len(ds)} records"
    rec = ds[0]
    rec.check()
    choice = captured["choices"][0]
    want = list(choice["prompt_token_ids"]) + list(choice["token_ids"])[:-1]  # the last sampled token never ran
    assert rec.meta["mode"] == "generate"
    assert rec.token_ids.tolist() == want
    assert rec.meta["token_digest"] == token_digest(want)
    assert rec.hidden_states.shape[:2] == (len(want), 4)
    assert plain["choices"][0]["text"]  # the other request was served normally
    assert json.loads((out / "dataset.json").read_text())["layer_ids"] == [1, 2, 3, 4]
