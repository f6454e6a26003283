"""Pipeline config (YAML, overrides, unknown keys, validation, --help) and the inference manager's
count guard / one-retry / rates, against a fake Tap (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layertap.data import InputItem
from layertap.pipeline.config import CaptureSection, TrainSection, apply_overrides, config_help, from_dict, load_yaml
from layertap.pipeline.manager import InferenceManager, RequestsFailed
from layertap.records import Record
from layertap.tap import CaptureError, Rejected

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "run.yaml"


def test_defaults_build():
    cfg = from_dict({})
    assert cfg.drafter == "eagle3" and cfg.capture.transport == "shm" and cfg.target is None


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("drafter: dflash\ncapture:\n  limit: 40\ntrain:\n  lr: 1\nengine:\n  max_num_seqs: 8\n")
    d = apply_overrides(load_yaml(p), ["train.max_steps=7", "capture.layers=[1, 2]", "out=123", "engine.dtype=float32"])
    cfg = from_dict(d)
    assert cfg.drafter == "dflash" and cfg.capture.limit == 40 and cfg.train.max_steps == 7
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.capture.layers == [1, 2] and cfg.out == "123"  # a path YAML reads as a number stays a string
    assert cfg.engine == {"max_num_seqs": 8, "dtype": "float32"}


def test_example_config_is_valid():
    cfg = from_dict(load_yaml(EXAMPLE))
    assert cfg.drafter in ("eagle3", "dflash")


@pytest.mark.parametrize("d, needle", [
    ({"trian": {}}, "unknown config key trian"),
    ({"train": {"max_step": 3}}, "train.max_step"),
    ({"capture": {"transport": "tcp"}}, "capture.transport"),
    ({"train": {"batch_size": 0}}, "train.batch_size"),
    ({"capture": {"transport": "mooncake"}}, "capture.mooncake_master"),
    ({"drafter": "medusa"}, "drafter"),
    ({"train": 3}, "section 'train'"),
])
def test_bad_config_names_the_key(d, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        from_dict(d)


def test_bad_override_names_the_key():
    with pytest.raises(ValueError, match=r"eval\.evry"):
        apply_overrides({}, ["eval.evry=3"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        apply_overrides({}, ["train.lr"])


def test_help_lists_every_key():
    import dataclasses

    text = config_help()
    for sec, cls in (("capture", CaptureSection), ("train", TrainSection)):
        for f in dataclasses.fields(cls):
            assert f"{sec}.{f.name}" in text


def test_cli_help_documents_every_flag(capsys):
    from layertap.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for flag in ("--target", "--data", "--drafter", "--out", "--config", "--set", "--resume", "eval.every"):
        assert flag in out


# -- manager ---------------------------------------------------------------------------------------
def _rec(i: int) -> Record:
    ids = torch.arange(5)
    return Record(index=i, token_ids=ids, hidden_states=torch.zeros(5, 1, 4), layer_ids=[1], num_prompt_tokens=2,
                  meta={"key": f"k{i}"})


class FakeTap:
    """Yields records for its inputs; ``fail_at`` raises CaptureError after that many; ``drop`` never
    yields those indices; ``too_long`` rejects them up front."""

    made = 0

    def __init__(self, fail_at: int | None = None, drop: set[int] = frozenset(), too_long: set[int] = frozenset()):
        FakeTap.made += 1
        self.fail_at, self.drop, self.too_long = fail_at, drop, too_long
        self.rejected: list[Rejected] = []
        self.closed = False

    def capture(self, inputs, *, mode="prompt", sampling_params=None, skip_indices=None):
        n = 0
        for it in inputs:
            if it.index in self.too_long:
                self.rejected.append(Rejected(it.index, "too long"))
                continue
            if self.fail_at is not None and n == self.fail_at:
                raise CaptureError(f"input {it.index}: engine hiccup")
            n += 1
            if it.index not in self.drop:
                yield _rec(it.index)

    def close(self):
        self.closed = True


def _items(n: int) -> list[InputItem]:
    return [InputItem(i, [1, 2, 3]) for i in range(n)]


def _drain(mgr: InferenceManager) -> list[int]:
    try:
        return [r.index for r in mgr.start().records()]
    finally:
        mgr.close()


def test_manager_all_records_and_rates():
    mgr = InferenceManager(lambda: FakeTap(), _items(10), skip={0, 1}, queue_records=2)
    assert sorted(_drain(mgr)) == list(range(2, 10))
    s = mgr.rates.summary()
    assert s["submitted"] == 8 and s["records"] == 8 and s["consumer_records"] == 8 and s["retried"] == 0
    assert 0.0 <= s["trainer_idle_fraction"] <= 1.0


def test_manager_retries_once_on_a_fresh_engine():
    taps = iter([FakeTap(fail_at=3), FakeTap()])
    mgr = InferenceManager(lambda: next(taps), _items(8))
    got = _drain(mgr)
    assert sorted(got) == list(range(8)) and len(got) == 8  # nothing twice
    assert mgr.rates.retried == [3, 4, 5, 6, 7]


def test_manager_names_inputs_missing_after_the_retry():
    mgr = InferenceManager(lambda: FakeTap(drop={2, 5}), _items(7))
    with pytest.raises(RequestsFailed, match=r"2 of 7 submitted inputs have no record after 1 retry: input indices 2, 5"):
        _drain(mgr)


def test_manager_rejections_are_named_not_retried():
    mgr = InferenceManager(lambda: FakeTap(too_long={4}), _items(6))
    assert sorted(_drain(mgr)) == [0, 1, 2, 3, 5]
    assert list(mgr.rates.rejected) == [4] and mgr.rates.retried == []


def test_manager_second_failure_is_named():
    mgr = InferenceManager(lambda: FakeTap(fail_at=1), _items(4))
    with pytest.raises(RequestsFailed, match="first error: CaptureError: input 1: engine hiccup"):
        _drain(mgr)


def test_manager_close_stops_a_blocked_producer():
    mgr = InferenceManager(lambda: FakeTap(), _items(100), queue_records=1).start()
    first = next(mgr.records())
    assert first.index == 0
    mgr.close(timeout=5)
    assert not mgr._thread.is_alive()


def test_wrong_types_name_the_key():
    with pytest.raises(ValueError, match=r"train\.max_steps"):
        from_dict({"train": {"max_steps": "many"}})
    with pytest.raises(ValueError, match=r"capture\.regenerate"):
        from_dict({"capture": {"regenerate": 1}})


def test_float_override_in_exponent_form_without_a_dot():
    """YAML 1.1 reads ``1e-3`` as a string; ``layertap train --help`` shows exactly that example."""
    cfg = from_dict(apply_overrides({}, ["train.lr=1e-3"]))
    assert cfg.train.lr == 0.001 and isinstance(cfg.train.lr, float)
    assert from_dict(apply_overrides({}, ["train.lr=2E-2"])).train.lr == 0.02
    with pytest.raises(ValueError, match="train.lr"):
        from_dict(apply_overrides({}, ["train.lr=fast"]))
