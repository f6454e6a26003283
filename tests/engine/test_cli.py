"""The command line as a user runs it: capture -> verify (exit 0), a tampered dataset (exit 1), resume of
an interrupted capture, and streaming over shm into a dataset."""

import json
import subprocess
import sys

import pytest
import torch

from layertap.models.tiny import tiny_model
from layertap.records import token_digest
from layertap.transport.file import FileSink, load_records

pytestmark = pytest.mark.engine
ENGINE = ["--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
          "--kv-cache-memory-bytes", str(64 << 20)]


def cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "layertap", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    f = d / "convs.jsonl"
    rows = [json.loads(l) for l in open("layertap/data_files/sample_convs.jsonl")][:12]
    rows.append({"prompt": "def main():"})
    rows.append({"token_ids": [5, 6, 7, 8, 9]})
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first = d / "first.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    return d, f, first, len(rows)


def test_capture_resume_over_shm_then_verify_and_tamper(data):
    d, full, first, n = data
    model = tiny_model("qwen3")
    out = d / "ds"
    p = cli("capture", "--model", model, "--data", first, "--layers", "1,2,4", "--out", out, *ENGINE)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(load_records(out)) == 5
    # The same inputs plus more: the first five are skipped, the rest stream over shm into the dataset.
    p = cli("capture", "--model", model, "--data", full, "--layers", "1,2,4", "--out", out, "--transport", "shm",
            *ENGINE)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming" in p.stderr and f"5 of {n}" in p.stderr
    ds = load_records(out)
    assert sorted(r.index for r in ds) == list(range(n))
    assert ds.manifest["layer_ids"] == [1, 2, 4] and ds.manifest["config_hash"]

    p = cli("verify", out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "ALL RECORDS MATCH" in p.stdout

    # A record whose states are not the model's: the digest is right (it claims the right tokens), the
    # rows are perturbed in one layer. verify must name it and exit 1.
    rec = ds[3]
    bad = rec.hidden_states.clone()
    bad[:, 1] += 0.5 * torch.randn_like(bad[:, 1]) * bad[:, 1].std()
    sink = FileSink(out, "tamper")
    sink.put("tampered", {"token_ids": rec.token_ids, "hidden_states": bad},
             {**rec.meta, "key": "tampered", "index": 999, "token_digest": token_digest(rec.token_ids)})
    sink.close()
    p = cli("verify", out)
    assert p.returncode == 1
    assert "MISMATCH" in p.stdout and "record tampered (index 999) layer 2" in p.stdout
