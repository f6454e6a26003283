"""layertap.verify's noise floor for half-precision records, with real HF passes on a tiny model.

A correct bf16 capture differs from the fp32 reference by rounding, which grows with depth (0.998 at layer
32 of an 8B-shaped model on the H200, below the fixed 0.999). On the CPU a tiny model drifts less, so these
tests stand a strict threshold (0.99999) in for a deep model's: a "record" holding HF's own bf16 rows then
fails on the threshold alone and passes with the noise floor, while the bug classes the check exists for
(another token's rows, another layer's, another request's) still fail with it."""

from __future__ import annotations

import pytest
import torch

from layertap.models.tiny import TinySpec, build_tiny_model, default_cache_dir, spec_hash
from layertap.records import Record
from layertap.verify import HFReference, VerifyReport, noise_dtype_for, print_report, verify_records

LAYERS = [1, 6, 12]
STRICT = 0.99999  # above this model's bf16 drift (~0.9998), as 0.999 is above an 8B model's at depth


@pytest.fixture(scope="module")
def model():
    spec = TinySpec(kind="qwen3", hidden_size=256, num_layers=12, num_heads=4, num_kv_heads=1, head_dim=64,
                    intermediate_size=768, vocab_size=512, max_position_embeddings=1024)
    return build_tiny_model(default_cache_dir() / f"verify-noise-{spec_hash(spec)}", spec)


@pytest.fixture(scope="module")
def bf16_rows(model):
    """Two prompts and HF's own bf16 planes for them: what a correct bf16 engine's capture looks like."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 500, (96,), generator=g) for _ in range(2)]
    ref = HFReference(model, dtype=torch.bfloat16)
    return prompts, [ref.planes(p, LAYERS).to(torch.bfloat16).cpu() for p in prompts]


def _rec(i, ids, planes, layers=LAYERS):
    return Record(index=i, token_ids=ids, hidden_states=planes, layer_ids=list(layers), num_prompt_tokens=len(ids),
                  meta={"key": f"r{i}"})


def test_half_precision_rows_pass_on_the_noise_floor_not_the_threshold(model, bf16_rows):
    prompts, planes = bf16_rows
    recs = [_rec(i, p, h) for i, (p, h) in enumerate(zip(prompts, planes))]
    strict = verify_records(recs, model, threshold=STRICT, noise="off", progress=False)
    assert not strict.ok and strict.failures  # rounding alone, judged by the fixed threshold
    rep = verify_records(recs, model, threshold=STRICT, progress=False)  # noise="auto": the records are bf16
    assert rep.ok, rep.failures
    assert rep.noise_dtype == "bfloat16"
    for lid in LAYERS:
        s = rep.per_layer[lid]
        assert s.noise_min_cos is not None and s.noise_min_cos < STRICT
        # the records are HF's own bf16 rows: exactly at the floor, well inside 2x it
        assert abs(s.min_cos - s.noise_min_cos) < 1e-6
        assert s.allowed_min_cos == pytest.approx(1 - 2 * (1 - s.noise_min_cos))
        assert s.failed == 0
    print_report(rep)  # the table names the floor's dtype and the allowed cosine


@pytest.mark.parametrize("bug", ["next token's rows", "another layer's rows", "another request's rows"])
def test_the_noise_floor_still_catches_wrong_rows(model, bf16_rows, bug):
    prompts, planes = bf16_rows
    h = planes[0].clone()
    if bug == "next token's rows":
        h = torch.roll(h, shifts=-1, dims=0)
    elif bug == "another layer's rows":
        h = h[:, [1, 1, 2]]  # plane 0 (layer 1) holds layer 6's rows
    else:
        h = planes[1][: h.shape[0]]
    rep = verify_records([_rec(0, prompts[0], h)], model, threshold=STRICT, progress=False)
    assert not rep.ok
    assert "HF's own bfloat16 pass" in rep.failures[0]
    assert sum(s.failed for s in rep.per_layer.values()) >= 1  # what the report's table marks MISMATCH


def test_noise_dtype_choice(bf16_rows):
    prompts, planes = bf16_rows
    rec16, rec32 = _rec(0, prompts[0], planes[0]), _rec(0, prompts[0], planes[0].float())
    assert noise_dtype_for(rec16, torch.float32, "auto") == torch.bfloat16
    assert noise_dtype_for(rec32, torch.float32, "auto") is None  # fp32 records: the threshold alone
    assert noise_dtype_for(rec16, torch.bfloat16, "auto") is None  # a half reference has no fp32 truth
    assert noise_dtype_for(rec32, torch.float32, "float16") == torch.float16
    assert noise_dtype_for(rec16, torch.float32, "off") is None
    with pytest.raises(ValueError, match="noise dtype 'fp8'"):
        noise_dtype_for(rec16, torch.float32, "fp8")
    with pytest.raises(ValueError, match="noise_factor 0.5"):
        verify_records([rec16], "unused", noise_factor=0.5)
    assert VerifyReport(0.999, LAYERS).allowed(None) == 0.999
    assert VerifyReport(0.999, LAYERS).allowed(0.99999) == 0.999  # never stricter than the threshold
