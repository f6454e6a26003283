"""Bad input gets a clear error naming the problem, before any engine starts, and writes nothing."""

import json
import subprocess
import sys
import time

import pytest

from layertap.data import InputError, load_inputs
from layertap.models.tiny import tiny_model
from layertap.targetinfo import TargetError, TargetInfo


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def run_cli(*args, timeout=60):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "layertap.cli", *args], capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


@pytest.mark.parametrize("layers,msg", [
    ([5], r"bad layer id\(s\) \[5\]: valid ids are 0..4"),
    ([-1, 2], r"bad layer id\(s\) \[-1\]"),
    ([1, 2, 2], r"duplicate layer id\(s\) \[2\]"),
    ([], "no layer ids"),
])
def test_layer_ids_checked(model, layers, msg):
    with pytest.raises(TargetError, match=msg):
        TargetInfo.load(model).check_layer_ids(layers)


def test_layer_ids_sorted_to_plane_order(model):
    assert TargetInfo.load(model).check_layer_ids([4, 0, 2]) == [0, 2, 4]


def test_unknown_model():
    with pytest.raises(TargetError, match="unknown model '/nonexistent/m'"):
        TargetInfo.load("/nonexistent/m")


def test_malformed_jsonl_names_the_line(tmp_path, model):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": oops}\n')
    with pytest.raises(InputError, match=r"in.jsonl:3: malformed JSON"):
        load_inputs(f, TargetInfo.load(model).tokenizer)


@pytest.mark.parametrize("obj,msg", [
    ({"prompt": ""}, "empty prompt"),
    ({"token_ids": []}, "empty prompt"),
    ({"token_ids": [1, "x"]}, "must be a list of ints"),
    ({"token_ids": [1, True, 3]}, "must be a list of ints"),
    ({"token_ids": [1, 2.0]}, "must be a list of ints"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, "'role' and 'content'"),
    ({"text": "hi"}, "expected a key 'prompt'"),
    ({"token_ids": [5, 999999]}, "outside the vocabulary"),
    ({"token_ids": [5, -1, 7]}, r"token ids \[-1\] are outside the vocabulary"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "unknown ShareGPT role"),
])
def test_bad_records_name_the_problem(tmp_path, model, obj, msg):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"prompt": "fine"}) + "\n" + json.dumps(obj) + "\n")
    with pytest.raises(InputError, match=f"in.jsonl:2: .*{msg}"):
        load_inputs(f, TargetInfo.load(model).tokenizer)


def test_sharegpt_maps_to_messages(model):
    tok = TargetInfo.load(model).tokenizer
    a = load_inputs([{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}], tok)[0]
    b = load_inputs([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}], tok)[0]
    assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and sum(a.loss_mask) > 0


@pytest.mark.parametrize("case", ["layer", "jsonl", "model", "outdir"])
def test_cli_fails_fast_with_named_error_and_writes_nothing(tmp_path, model, case):
    data = tmp_path / "in.jsonl"
    data.write_text('{"prompt": "def f():"}\n' + ('{"prompt": \n' if case == "jsonl" else ""))
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    out = blocker / "sub" if case == "outdir" else tmp_path / "out"
    args = ["capture", "--model", "/no/such/model" if case == "model" else str(model), "--data", str(data),
            "--layers", "1,9" if case == "layer" else "1,2", "--out", str(out)]
    p, took = run_cli(*args)
    want = {"layer": "bad layer id(s) [9]", "jsonl": "in.jsonl:2: malformed JSON", "model": "unknown model",
            "outdir": "not writable"}[case]
    assert p.returncode == 2, p.stderr[-2000:]
    assert want in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert took < 45, "the error should come before any engine starts"
    if case != "outdir":
        assert not out.exists() or not any(out.glob("index-*.jsonl"))
