"""Trainer: learning on a fixed batch, bit-exact resume, one code path for offline and streamed records,
metrics artefacts (TensorBoard events, PNG), export file layout. Catching a drafter served the wrong
layers needs a trained target: that test is in tests/engine/test_export_eval.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from layertap.drafters.eagle3 import draft_vocab_from_counts
from layertap.drafters.export import export
from layertap.train.config import DFlashConfig, Eagle3Config, TrainConfig
from layertap.train.data import collate, epoch_stream, token_counts
from layertap.train.fixtures import shape, tiny_records, tiny_target
from layertap.train.trainer import Trainer

torch.set_num_threads(1)


def _trainer(kind: str, out, *, steps: int = 6, lr: float = 3e-3, aux=(1, 2, 3), tb: bool = False) -> Trainer:
    tcfg = TrainConfig(out_dir=str(out), max_steps=steps, batch_size=2, lr=lr, warmup_steps=2, log_every=1000,
                       tensorboard=tb, max_len=96)
    if kind == "eagle3":
        recs = tiny_records()
        cfg = Eagle3Config(shape=shape(), aux_layer_ids=list(aux), last_layer_id=4, draft_vocab_size=512)
        ids = draft_vocab_from_counts(token_counts(recs, 2048), 512)
        return Trainer("eagle3", cfg, tcfg, tiny_target(), ids)
    cfg = DFlashConfig(shape=shape(), target_layer_ids=[a - 1 for a in aux], block_size=4, mask_token_id=4,
                       anchors_per_seq=16)
    return Trainer("dflash", cfg, tcfg, tiny_target())


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_loss_decreases_on_fixed_batch(kind, tmp_path):
    # DFlash learns slower here: its output goes through the random target's frozen lm_head, whose
    # small logits need the draft norm's gain to grow first; anchors are also resampled every step.
    steps, lr, ratio = {"eagle3": (40, 3e-3, 0.6), "dflash": (60, 1e-2, 0.85)}[kind]
    tr = _trainer(kind, tmp_path, steps=steps, lr=lr)
    batch = collate(tiny_records()[:2], tr._layer_ids()[0], tr._layer_ids()[1], 96)
    first = tr.train_step(batch)
    for _ in range(steps - 2):
        last = tr.train_step(batch)
    assert last["loss"] < ratio * first["loss"], (first["loss"], last["loss"])
    assert last["acc"][0] > first["acc"][0]


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_resume_equals_uninterrupted(kind, tmp_path):
    recs = list(tiny_records())
    full = _trainer(kind, tmp_path / "full", steps=8)
    full.fit(epoch_stream(recs, 2, 0))
    part = _trainer(kind, tmp_path / "part", steps=8)
    part.fit(epoch_stream(recs, 2, 0), stop_after=4)  # interrupted mid-cosine, mid-epoch
    ckpt = part.save()
    resumed = Trainer.load(ckpt)
    assert resumed.step == 4
    resumed.fit(epoch_stream(recs, 2, 0))  # the same re-iterable source; the consumed prefix is skipped
    assert resumed.step == full.step == 8
    assert [h["loss"] for h in resumed.log.history] == [h["loss"] for h in full.log.history]
    for (n, a), (_, b) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n


def test_stream_and_dataset_share_one_path(tmp_path):
    """Online training: a generator that hands records over one by one trains exactly like a list."""
    recs = list(tiny_records())

    def live():
        for r in recs:
            yield r

    a = _trainer("eagle3", tmp_path / "a", steps=3)
    a.fit(recs)
    b = _trainer("eagle3", tmp_path / "b", steps=3)
    b.fit(live())
    for (n, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), n


def test_finish_writes_png_tensorboard_and_history(tmp_path):
    tr = _trainer("eagle3", tmp_path, steps=3, tb=True)
    tr.fit(tiny_records())
    tr.finish()
    png = (tmp_path / "training.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    hist = json.loads((tmp_path / "history.json").read_text())
    assert len(hist) == 3 and len(hist[0]["acc"]) == 3


@pytest.mark.parametrize("kind,fmt", [("eagle3", "legacy"), ("eagle3", "speculators"), ("dflash", "zlab"),
                                      ("dflash", "speculators")])
def test_export_layout(kind, fmt, tmp_path):
    tr = _trainer(kind, tmp_path / "run", steps=1)
    tr.fit(tiny_records())
    out = export(tr.save(), tmp_path / "out", fmt)
    conf = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        if kind == "eagle3":
            d2t = f.get_tensor("d2t")
            assert d2t.dtype == torch.int64
            assert torch.equal(torch.arange(512) + d2t, tr.model.draft_ids)
    assert not any(n.startswith(("embed_tokens", "lm_head.weight")) and kind == "dflash" for n in names)
    if kind == "eagle3":
        # speculators names the decoder layer layers.0 (vLLM maps midlayer. to layers.0. itself)
        layer = "midlayer." if fmt == "legacy" else "layers.0."
        assert {"fc.weight", layer + "self_attn.q_proj.weight", "lm_head.weight", "d2t"} <= names
        assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    else:
        assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
        ids = conf["dflash_config"]["target_layer_ids"] if fmt == "zlab" else conf["aux_hidden_state_layer_ids"]
        assert ids == ([0, 1, 2] if fmt == "zlab" else [1, 2, 3])


def test_online_from_transport_source(tmp_path):
    """Records written to a ``file`` dataset while the trainer tails it (FileSource.poll) train exactly
    like the same records handed over as a list."""
    from layertap.train.data import records_from_source, write_dataset
    from layertap.transport.file import FileSource

    recs = list(tiny_records())
    write_dataset(recs, tmp_path / "ds", {"model": str(tiny_target())})
    src = FileSource(tmp_path / "ds")
    online = _trainer("eagle3", tmp_path / "online", steps=3)
    online.fit(records_from_source(src, poll_timeout=0.01, idle_timeout=0.2))
    src.close()
    offline = _trainer("eagle3", tmp_path / "offline", steps=3)
    offline.fit(recs)
    assert online.step == 3
    for (n, x), (_, y) in zip(online.model.state_dict().items(), offline.model.state_dict().items()):
        assert torch.equal(x, y), n


def _loop(tr: Trainer, out):
    from layertap.pipeline.config import EvalSection, PipelineConfig, TrainSection
    from layertap.pipeline.run import Loop

    cfg = PipelineConfig(out=str(out), train=TrainSection(max_steps=tr.tcfg.max_steps, batch_size=2, max_len=96,
                                                          save_every=0, log_every=1000),
                         eval=EvalSection(every=0))
    out.mkdir(parents=True, exist_ok=True)
    return Loop(cfg, tr, out, None)


def test_online_loop_self_tests_the_last_layer(tmp_path, capsys):
    """`layertap train` checks the first records of the stream as train-offline checks its dataset: on the
    target's greedy spans the last layer id must reproduce the target's tokens. Right rows pass and train;
    rows of layer N-1 under id N stop the run at the first record, before any optimizer step."""
    import dataclasses

    recs = tiny_records(4, greedy_tokens=12)
    tr = _trainer("eagle3", tmp_path / "ok", steps=2)
    _loop(tr, tmp_path / "ok").run(iter(recs))
    assert tr.step == 2
    assert "head self-test (layer id 4): greedy-span agreement 1.000 over 4 records" in capsys.readouterr().out

    def shifted(r):  # id 4's plane holds layer 3's rows: the off-by-one the test exists for
        h = r.hidden_states.clone()
        h[:, 4] = r.hidden_states[:, 3]
        return dataclasses.replace(r, hidden_states=h)

    bad = _trainer("eagle3", tmp_path / "bad", steps=2)
    with pytest.raises(ValueError,
                       match=r"agreement 0\.\d+ over 1 records.*layer id 4 is not the pre-norm last state"):
        _loop(bad, tmp_path / "bad").run(iter([shifted(r) for r in recs]))
    assert bad.step == 0


def test_greedy_argmax_in_slices_equals_argmax(monkeypatch):
    """The self-test's float32 argmax, one vocabulary slice at a time, equals the head's whole argmax."""
    from layertap.models import head as head_mod

    head = head_mod.TargetHead.from_pretrained(tiny_target())
    h = torch.randn(40, head.hidden_size)
    want = head(h.float()).argmax(-1)
    monkeypatch.setattr(head_mod, "ARGMAX_CHUNK", 300)  # 2048 ids: 7 slices, the last a partial one
    assert torch.equal(head_mod.greedy_argmax(head, h), want)
    with pytest.raises(ValueError, match="state width 64 != hidden size"):
        head_mod.greedy_argmax(head, torch.randn(3, 64))


def test_agreement_counts_near_ties_only_where_asked_and_only_near_ones():
    """A greedy span whose token lost the float32 argmax by a rounding step (a bf16 engine's near-tie)
    agrees with ``near_tie``; a token far below the best logit never does."""
    from layertap.models import head as head_mod

    head = head_mod.TargetHead.from_pretrained(tiny_target())
    h = torch.randn(20, head.hidden_size)
    logits = head(h.float())
    best = logits.argmax(-1)
    runner_up = logits.topk(2, -1).indices[:, 1]
    gap = (logits.max(-1).values - logits.gather(1, runner_up[:, None])[:, 0]) / logits.max(-1).values.abs().clamp_min(1)
    near, far = int(gap.argmin()), int(gap.argmax())
    worst = logits.argmin(-1)
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), best])  # row t predicts token t + 1
    tokens[near + 1] = runner_up[near]  # the engine picked the runner-up of a near-tie
    tokens[far + 1] = worst[far]  # and, elsewhere, a token far below the best
    exact = head_mod.agreement(head, h, tokens, 0)
    assert exact == pytest.approx(18 / 20)
    tol = float(gap[near]) * 1.01
    assert head_mod.agreement(head, h, tokens, 0, near_tie=tol) == pytest.approx(19 / 20)
    assert float(gap[far]) > tol  # the far miss stays a miss at that tolerance
