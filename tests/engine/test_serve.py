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
           "--kv-cache-memory-bytes", str(64 << 20), "--max-num-batched-tokens", "64"]  # prompts > 64: chunked
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


def _complete(url: str, prompt: str, capture: bool, **sampling) -> dict:
    body = {"model": str(trained_target()), "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
            "return_token_ids": True, **sampling}
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
    # No wait for a stray record: the plain request finished before the captured one started, so a record
    # wrongly written for it would have committed before the captured request's record.
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


def test_seeded_sampling_with_chunked_prefill_is_served_and_captured(server):
    """A seeded, sampled completion whose prompt is prefilled in chunks (> 64 tokens, 64 per step) once
    killed the CPU engine. Now it is served and captured, and the same request again (its prompt then hits
    the prefix cache: fewer chunks) samples the same tokens, so the discarded draws were undone."""
    url, out = server
    prompt = "import os\nimport sys\n" * 20
    before = {r.key for r in load_records(out)}
    a = _complete(url, prompt, capture=True, temperature=0.9, seed=5, n=2)
    b = _complete(url, prompt, capture=True, temperature=0.9, seed=5, n=2)
    assert len(a["choices"][0]["prompt_token_ids"]) > 64
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    assert requests.get(url + "/health", timeout=5).status_code == 200
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and len(load_records(out)) < len(before) + 4:
        time.sleep(0.2)
    recs = [r for r in load_records(out) if r.key not in before]
    assert len(recs) == 4, f"{len(recs)} records for 2 requests x n=2"
    want = sorted(list(c["prompt_token_ids"] or a["choices"][0]["prompt_token_ids"]) + list(c["token_ids"])[:-1]
                  for c in a["choices"] + b["choices"])
    assert sorted(r.token_ids.tolist() for r in recs) == want
