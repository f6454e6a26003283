"""Drafter numerics without an engine: masks, alignment, vocab maps, the target head, id conventions."""

from __future__ import annotations

import json
import math

import pytest
import torch

from layertap.drafters.common import rope
from layertap.drafters.dflash import DFlashDrafter, sample_anchors
from layertap.drafters.eagle3 import Eagle3Drafter, draft_vocab_from_counts, ttt_attention
from layertap.drafters.export import dflash_config, eagle3_config
from layertap.models.head import TargetHead, agreement
from layertap.train.config import DFlashConfig, Eagle3Config, TrainConfig
from layertap.train.data import collate
from layertap.train.fixtures import shape, tiny_records, tiny_target
from layertap.train.selftest import head_selftest

torch.set_num_threads(1)


def _eagle(vocab: int = 256, steps: int = 3) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = Eagle3Config(shape=shape(), aux_layer_ids=[1, 2, 3], last_layer_id=4, draft_vocab_size=vocab,
                       ttt_steps=steps)
    return Eagle3Drafter(cfg, torch.randn(2048, 128), torch.randperm(2048)[:vocab])


def _dflash(block: int = 4) -> DFlashDrafter:
    torch.manual_seed(0)
    cfg = DFlashConfig(shape=shape(), target_layer_ids=[0, 1, 2], block_size=block, mask_token_id=7)
    return DFlashDrafter(cfg, torch.randn(2048, 128), torch.randn(2048, 128) * 0.1)


def test_ttt_attention_matches_explicit_mask():
    """Step-j queries see step-0 keys <= t and only index t of steps 1..j: compare against an explicit
    [T, (j+1)T] mask over concatenated keys."""
    torch.manual_seed(0)
    b, h, t, d, j = 2, 3, 5, 8, 2
    q = torch.randn(b, h, t, d)
    ks = [torch.randn(b, h, t, d) for _ in range(j + 1)]
    vs = [torch.randn(b, h, t, d) for _ in range(j + 1)]
    mask = torch.zeros(t, (j + 1) * t, dtype=torch.bool)
    mask[:, :t] = torch.ones(t, t).tril().bool()
    for i in range(1, j + 1):
        mask[:, i * t : (i + 1) * t] = torch.eye(t, dtype=torch.bool)
    ref = torch.nn.functional.scaled_dot_product_attention(q, torch.cat(ks, 2), torch.cat(vs, 2), attn_mask=mask)
    torch.testing.assert_close(ttt_attention(q, ks, vs), ref, atol=1e-5, rtol=1e-5)


def test_eagle3_is_causal_across_unroll():
    """Output at index t of every unroll step must not depend on inputs after t + step (teacher forcing
    feeds x_{t+1+j}); a future-peeking mask would train a drafter that cannot serve."""
    m = _eagle()
    t = 12
    aux, ids = torch.randn(1, t, 384), torch.randint(0, 2048, (1, t))
    base = torch.arange(t).view(1, t)
    outs = []
    for a, i in ((aux, ids), (aux.clone(), ids.clone())):
        a[:, 8:] += 1.0
        i[:, 9:] = 5
        feat, cache, res = m.fc(a), [], []
        for j in range(3):
            from layertap.drafters.eagle3 import shift_left

            feat = m.step(shift_left(i, 1 + j), feat, base + j, cache)
            res.append(feat)
        outs.append(res)
    for j in range(3):
        # step j at index t consumed tokens up to t+1+j and features up to t: rows t <= 7 - j are clean
        torch.testing.assert_close(outs[0][j][:, : 8 - j], outs[1][j][:, : 8 - j])


def test_draft_vocab_maps_round_trip():
    counts = torch.zeros(2048, dtype=torch.long)
    counts[[5, 900, 17, 2000]] = torch.tensor([10, 9, 9, 1])
    ids = draft_vocab_from_counts(counts, 3)
    assert ids.tolist() == [5, 17, 900]  # ties by lower id, sorted ascending
    m = Eagle3Drafter(_eagle().cfg.__class__(shape=shape(), aux_layer_ids=[1, 2, 3], last_layer_id=4,
                                            draft_vocab_size=3), torch.randn(2048, 128), ids)
    # vLLM maps draft index i to target id i + d2t[i] (offsets, not absolute ids)
    assert (torch.arange(3) + m.d2t).tolist() == [5, 17, 900]
    assert m.t2d.sum() == 3 and m.t2d[[5, 17, 900]].all()


def test_dflash_context_stops_strictly_before_anchor():
    """Block logits may depend on context rows < anchor only (SpecForge #473 bug: including the anchor)."""
    m = _dflash()
    t, a = 16, 9
    aux, ids = torch.randn(1, t, 384), torch.randint(0, 2048, (1, t))
    anchors = torch.tensor([[a]])
    base = m.block_logits(aux, ids, anchors)
    later = aux.clone()
    later[:, a:] += 3.0
    torch.testing.assert_close(m.block_logits(later, ids, anchors), base)
    before = aux.clone()
    before[:, a - 1] += 3.0
    assert not torch.allclose(m.block_logits(before, ids, anchors), base)


def test_dflash_labels_are_unshifted():
    """Slot j is scored against the token AT position anchor + j."""
    m = _dflash(block=3)
    t = 10
    aux, ids = torch.randn(1, t, 384), torch.randint(0, 2048, (1, t))
    mask, lengths, anchors = torch.ones(1, t), torch.tensor([t]), torch.tensor([[4]])
    logp = torch.log_softmax(m.block_logits(aux, ids, anchors).float(), -1)[0, 0]
    stats = m(aux, ids, mask, lengths, anchors)
    for j in (1, 2):
        want = -logp[j, ids[0, 4 + j]] * math.exp(-(j - 1) / m.cfg.gamma)
        torch.testing.assert_close(stats[j - 1].loss, want)


def test_sample_anchors_respects_mask_and_bounds():
    mask = torch.zeros(2, 12)
    mask[0, 5:9] = 1
    gen = torch.Generator().manual_seed(0)
    a = sample_anchors(mask, torch.tensor([12, 12]), 10, gen)
    assert sorted(x for x in a[0].tolist() if x >= 0) == [4, 5, 6, 7]  # next token trained
    assert (a[1] == -1).all()


def test_rope_is_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    s1 = (rope(q, torch.tensor([[3]]), 1e4) * rope(k, torch.tensor([[1]]), 1e4)).sum()
    s2 = (rope(q, torch.tensor([[103]]), 1e4) * rope(k, torch.tensor([[101]]), 1e4)).sum()
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)


def test_records_from_hf_follow_layer_convention():
    """Id i < N equals HF hidden_states[i]; id N is pre-norm, and TargetHead(id N) gives HF's logits."""
    from transformers import AutoModelForCausalLM

    rec = tiny_records()[0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target()), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=rec.token_ids[None], output_hidden_states=True)
    for j, i in enumerate(rec.layer_ids[:-1]):
        torch.testing.assert_close(rec.hidden_states[:, j], out.hidden_states[i][0])
    head = TargetHead.from_pretrained(tiny_target())
    torch.testing.assert_close(head(rec.hidden_states[:, -1]), out.logits[0], atol=1e-4, rtol=1e-4)
    # HF's last hidden_states entry is post-norm: it must NOT equal our id N
    assert not torch.allclose(rec.hidden_states[:, -1], out.hidden_states[-1][0])


def test_head_selftest_catches_wrong_last_layer():
    """On greedy spans the head reproduces the target's tokens from id N; id N-1 or skipping the final
    norm must fail the self-test (the classic off-by-one / missing-verifier-norm bugs)."""
    recs = tiny_records(4, greedy_tokens=12)
    assert "greedy-span agreement 1.000" in head_selftest(tiny_target(), recs, 4)
    with pytest.raises(ValueError, match="layer id 3"):
        head_selftest(tiny_target(), recs, 3)
    head = TargetHead.from_pretrained(tiny_target())
    r = recs[0]
    raw = r.hidden_states[:, -1] @ head.lm_head.T  # no final norm
    start = r.num_prompt_tokens - 1
    assert agreement(head, r.hidden_states[:, -1], r.token_ids, start) == 1.0
    # without the verifier norm the soft labels EAGLE-3 trains on are wrong even where argmax survives
    logits = head(r.hidden_states[:, -1])
    assert (raw - logits).abs().max() > 0.1 * logits.abs().max()


def test_export_configs_follow_id_conventions():
    e = Eagle3Config(shape=shape(), aux_layer_ids=[1, 2, 3], last_layer_id=4, draft_vocab_size=512)
    legacy = eagle3_config(e, "legacy", "/t", 3)
    assert legacy["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert legacy["norm_before_residual"] is False and legacy["architectures"] == ["LlamaForCausalLMEagle3"]
    spec = eagle3_config(e, "speculators", "/t", 3)
    assert "model_type" not in spec and spec["norm_before_residual"] is False
    d = DFlashConfig(shape=shape(), target_layer_ids=[0, 1, 2], mask_token_id=4)
    assert d.aux_layer_ids == [1, 2, 3]
    z = dflash_config(d, "zlab", "/t")
    assert z["dflash_config"] == {"mask_token_id": 4, "target_layer_ids": [0, 1, 2]}
    s = dflash_config(d, "speculators", "/t")
    assert s["aux_hidden_state_layer_ids"] == [1, 2, 3] and "sliding_window_non_causal" not in s
    json.dumps(s)


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="aux_layer_ids"):
        Eagle3Config(shape=shape(), aux_layer_ids=[1, 4], last_layer_id=4, draft_vocab_size=8)
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig(shape=shape(), target_layer_ids=[0], mask_token_id=4, block_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        TrainConfig(out_dir="/tmp/x", batch_size=0)


def test_collate_picks_planes_by_id():
    recs = tiny_records(2)
    b = collate(recs, [3, 1], 4, 64)
    n = min(64, int(recs[0].token_ids.shape[0]))
    torch.testing.assert_close(b.aux[0, :n, :128], recs[0].hidden_states[:n, 3])
    torch.testing.assert_close(b.aux[0, :n, 128:], recs[0].hidden_states[:n, 1])
    with pytest.raises(ValueError, match="layer id 7 not captured"):
        collate(recs, [7], 4, 64)


def test_collate_widens_stored_bf16_rows_whole_or_gathered():
    """Batches are built from the rows' stored dtype (bf16 from a bf16 engine) and widened to float32 where
    they land; a record holding exactly the planes used is copied whole, one holding more is gathered first,
    and padding stays zero."""
    import dataclasses

    recs = tiny_records(3)
    bf = [dataclasses.replace(r, hidden_states=r.hidden_states.to(torch.bfloat16)) for r in recs]
    # Record 0 holds exactly ids [1, 3, 4] in that order: copied whole. Records 1-2 hold all five ids.
    bf[0] = dataclasses.replace(bf[0], hidden_states=bf[0].hidden_states[:, [1, 3, 4]].contiguous(),
                                layer_ids=[1, 3, 4])
    r2 = bf[2]  # shorter than the others: padded
    bf[2] = dataclasses.replace(r2, token_ids=r2.token_ids[:40], hidden_states=r2.hidden_states[:40],
                                loss_mask=None if r2.loss_mask is None else r2.loss_mask[:40])
    b = collate(bf, [1, 3], 4, 64, device="cpu")
    assert b.aux.dtype == torch.float32 and b.last.dtype == torch.float32
    for i, r in enumerate(recs):
        n = int(b.lengths[i])
        want = r.hidden_states[:n].to(torch.bfloat16).float()
        torch.testing.assert_close(b.aux[i, :n, :128], want[:, 1], rtol=0, atol=0)
        torch.testing.assert_close(b.aux[i, :n, 128:], want[:, 3], rtol=0, atol=0)
        torch.testing.assert_close(b.last[i, :n], want[:, 4], rtol=0, atol=0)
        assert float(b.aux[i, n:].abs().sum()) == 0.0 and float(b.mask[i, n:].sum()) == 0.0
    assert b.lengths.tolist() == [64, 64, 40]


def test_dflash_greedy_replay_is_prefix_acceptance():
    """Per-position acceptance from the replay is non-increasing (acceptance stops at the first miss)
    and the mean acceptance length is 1 + their sum, as vLLM defines it."""
    from layertap.train.eval import dflash_greedy_acceptance

    m = _dflash(block=4)
    recs = tiny_records(2, greedy_tokens=12)
    b = collate(recs, [1, 2, 3], None, 96)
    per_pos, al, drafts = dflash_greedy_acceptance(m, b, 3)
    assert drafts > 0 and len(per_pos) == 3
    assert all(x >= y for x, y in zip(per_pos, per_pos[1:]))
    assert al == pytest.approx(1 + sum(per_pos))
