"""Compact storage (guarantee 6): loss-masked rows, fp16/bf16/fp8, round trip through records."""

from __future__ import annotations

import pytest
import torch

from layertap.records import IntegrityError, deserialize, serialize, to_record, token_digest
from layertap.transport.compact import DTYPES, compact, compact_from_config, kept_rows
from layertap.transport.base import get_transport


def sample(tokens: int = 40, layers: int = 3, hidden: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (tokens,), generator=g)
    hs = torch.randn(tokens, layers, hidden, generator=g)
    hs[:, :, 3] *= 50  # an outlier channel, as real residual streams have
    mask = torch.zeros(tokens, dtype=torch.uint8)
    mask[10:20] = 1
    mask[30:35] = 1
    meta = {"index": 7, "key": "req-7", "layer_ids": [0, 1, 2], "token_digest": token_digest(ids)}
    return {"token_ids": ids, "hidden_states": hs, "loss_mask": mask}, meta


def roundtrip(tensors, meta):
    return to_record(*deserialize(serialize(tensors, meta)))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_kept_rows_include_the_row_before_each_masked_span():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, 1, 1])
    assert kept_rows(mask).tolist() == [1, 2, 3, 4, 7, 8, 9]
    assert kept_rows(torch.zeros(4)).tolist() == []
    assert kept_rows(torch.ones(3)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype,bound", [("fp32", 0.0), ("fp16", 1e-3), ("bf16", 5e-3), ("fp8", 0.07)])
def test_dtype_round_trip_within_bound(dtype, bound):
    tensors, meta = sample()
    rec = roundtrip(*compact(tensors, meta, dtype=dtype))
    assert rec.hidden_states.shape == tensors["hidden_states"].shape
    assert rec.hidden_states.dtype == (torch.float32 if dtype == "fp8" else DTYPES[dtype])
    assert rel_err(rec.hidden_states, tensors["hidden_states"]) <= bound
    assert rec.meta["compact"] == {"only_loss_masked": False, "dtype": dtype}


def test_only_loss_masked_keeps_rows_positions_and_whole_token_ids():
    tensors, meta = sample()
    rec = roundtrip(*compact(tensors, meta, only_loss_masked=True, dtype="bf16"))
    pos = kept_rows(tensors["loss_mask"])
    assert torch.equal(rec.positions, pos) and pos.tolist()[:2] == [9, 10]
    assert torch.equal(rec.token_ids, tensors["token_ids"])  # digest still checks
    assert torch.equal(rec.hidden_states, tensors["hidden_states"][pos].to(torch.bfloat16))


def test_fp8_scale_dequantizes_in_to_record_and_zeros_survive():
    tensors, meta = sample()
    out, _ = compact(tensors, meta, dtype="fp8")
    assert out["hidden_states"].dtype == torch.float8_e4m3fn
    assert float(out["hidden_scale"]) == pytest.approx(float(tensors["hidden_states"].abs().max()) / 448)
    zeros = {**tensors, "hidden_states": torch.zeros(4, 3, 8), "token_ids": tensors["token_ids"][:4],
             "loss_mask": tensors["loss_mask"][:4]}
    rec = roundtrip(*compact(zeros, {**meta, "token_digest": token_digest(zeros["token_ids"])}, dtype="fp8"))
    assert torch.equal(rec.hidden_states, torch.zeros(4, 3, 8))


def test_tampered_positions_fail_check_naming_record():
    tensors, meta = sample()
    out, m = compact(tensors, meta, only_loss_masked=True)
    out["positions"] = out["positions"].flip(0).contiguous()
    with pytest.raises(IntegrityError, match="req-7.*increasing"):
        roundtrip(out, m)


def test_bad_inputs_raise_naming_record():
    tensors, meta = sample()
    with pytest.raises(ValueError, match="req-7.*loss_mask"):
        compact({k: v for k, v in tensors.items() if k != "loss_mask"}, meta, only_loss_masked=True)
    with pytest.raises(ValueError, match="req-7.*fp16"):
        compact({**tensors, "hidden_states": tensors["hidden_states"] * 1e4}, meta, dtype="fp16")
    bad = tensors["hidden_states"].clone()
    bad[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="req-7.*inf"):
        compact({**tensors, "hidden_states": bad}, meta, dtype="fp8")
    with pytest.raises(ValueError, match="req-7.*dtype"):
        compact(tensors, meta, dtype="int4")


def test_compacted_record_through_shm_with_config():
    shm = get_transport("shm")
    cfg = shm.prepare({"slot_bytes": 64 << 10, "num_slots": 2, "compact": {"only_loss_masked": True, "dtype": "fp8"}})
    with shm.make_source(cfg) as src:
        sink = shm.make_sink(cfg, "w")
        tensors, meta = sample()
        sink.put("req-7", *compact_from_config(tensors, meta, cfg))
        [rec] = src.poll(1)
        with rec:
            pos = kept_rows(tensors["loss_mask"])
            assert torch.equal(rec.positions, pos)
            assert rel_err(rec.hidden_states, tensors["hidden_states"][pos]) < 0.07
        sink.close()
