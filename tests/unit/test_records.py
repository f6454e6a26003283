"""The record blob's header (``records.layout``): written by hand for speed, it must stay the exact bytes a
safetensors reader expects, i.e. ``json.dumps(header, separators=(",", ":"))`` of the header dict, and it
must round-trip through ``serialize_into`` / ``deserialize``."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from layertap.records import (
    MetaTemplate,
    _NAMES,
    deserialize,
    ids_and_digest,
    layout,
    serialize_into,
    token_bytes,
    token_digest,
)


def _reference_prefix(tensors: dict, meta: dict) -> bytes:
    hdr = {"__metadata__": {"layertap": json.dumps(meta, sort_keys=True)}}
    off = 0
    for name, (dtype, shape) in tensors.items():
        n = dtype.itemsize
        for d in shape:
            n *= d
        hdr[name] = {"dtype": _NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(hdr, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


@pytest.mark.parametrize("tensors", [
    {"token_ids": (torch.int64, (1024,)), "hidden_states": (torch.bfloat16, (1024, 4, 2048))},
    {"token_ids": (torch.int64, (0,)), "hidden_states": (torch.float32, (0, 3, 8)), "loss_mask": (torch.uint8, (0,))},
    {},
    {'odd "name"\\': (torch.uint8, ())},
])
def test_header_is_the_json_of_the_header_dict(tensors):
    meta = {"key": 'r-"1"\\', "index": 3, "ü": [1, 2.5, None], "layer_ids": [1, 8], "nested": {"b": 1, "a": 2},
            "flag": True, "off": False, "none": None, "neg": -7, "big": 2**70, "f": 0.1, "tab\t": "é\n\u2028",
            "t": (1, "x")}
    prefix, spans, total = layout(tensors, meta)
    assert prefix == _reference_prefix(tensors, meta)
    assert len(prefix) % 8 == 0
    assert total == len(prefix) + sum(n for _, n in spans.values())


def test_blob_round_trips():
    ids = torch.arange(7, dtype=torch.int64)
    hs = torch.randn(7, 2, 5)
    meta = {"key": "k", "token_digest": token_digest(ids), "layer_ids": [1, 2]}
    tensors = {"token_ids": ids, "hidden_states": hs}
    buf = bytearray(layout(tensors, meta)[2])
    n = serialize_into(memoryview(buf), tensors, meta)
    got, got_meta = deserialize(memoryview(buf)[:n])
    assert torch.equal(got["token_ids"], ids) and torch.equal(got["hidden_states"], hs)
    assert got_meta == meta


SHARED = {"layer_ids": [1, 8, 13, 16], "layer_semantics": 'id i = "the" residual\\', "cache_group": {"index": 1, "b": [True]},
          "dtype": "bfloat16", "ü": 1.5}


@pytest.mark.parametrize("own", [
    {"key": "run:r-1", "index": 3, "num_tokens": 1024, "token_digest": "ab" * 32, "next_token_id": None, "mode": "prompt"},
    {"dtype": "float16", "layer_ids": [2], "zz": {"y": 1, "x": [1, 0]}},  # the record's own fields win, as in a dict merge
    {},
])
def test_template_writes_the_bytes_of_the_merged_manifest(own):
    """A record laid out on a MetaTemplate of the shared fields is byte for byte the record laid out on the
    merged manifest ({**shared, **own}): the engine's writer encodes the shared fields once, not per record."""
    tensors = {"token_ids": (torch.int64, (16,)), "hidden_states": (torch.bfloat16, (16, 4, 64))}
    t = MetaTemplate(SHARED)
    assert layout(tensors, own, t) == layout(tensors, {**SHARED, **own})
    assert layout(tensors, own, t)[0] == _reference_prefix(tensors, {**SHARED, **own})


def test_template_is_a_snapshot():
    shared = {"layer_ids": [1, 2], "model": "a"}
    t = MetaTemplate(shared)
    shared["layer_ids"].append(3)
    shared["model"] = "b"
    tensors = {"token_ids": (torch.int64, (4,))}
    assert layout(tensors, {"key": "k"}, t) == layout(tensors, {"layer_ids": [1, 2], "model": "a", "key": "k"})
    with pytest.raises(TypeError, match="str"):
        MetaTemplate({1: "x"})


def test_non_str_keys_follow_json():
    """A manifest with a non-str field name takes json's own rules (the key coerced), as before the hand encoding."""
    tensors = {"token_ids": (torch.int64, (4,))}
    assert layout(tensors, {2: "b", 1: "a"})[0] == _reference_prefix(tensors, {2: "b", 1: "a"})


def test_sha256_hex_is_sha256_in_pieces_that_keep_the_gil():
    """The digests on the engine's and the driver's hot threads are fed to hashlib below 2048 bytes at a time
    (hashlib releases the GIL from 2048 bytes on); the digest is sha256's, whatever the length or the input's
    type, and a record's token digest is unchanged."""
    import hashlib

    from layertap.records import _HASH_CHUNK, sha256_hex

    assert _HASH_CHUNK < 2048
    for n in (0, 1, 2046, 2047, 2048, 4094, 4095, 8192, 10001):
        data = bytes((7 * i) % 251 for i in range(n))
        want = hashlib.sha256(data).hexdigest()
        assert sha256_hex(data) == sha256_hex(bytearray(data)) == sha256_hex(memoryview(data)) == want
    ids = list(range(3, 3000, 3))
    want = hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()
    t = torch.tensor(ids + ids, dtype=torch.int64)[::2]  # not contiguous
    assert token_digest(ids) == token_digest(np.asarray(ids)) == token_digest(torch.tensor(ids)) == want
    assert token_digest(t[: len(ids)]) == hashlib.sha256(np.asarray((ids + ids)[::2][: len(ids)], dtype="<i8").tobytes()).hexdigest()
    assert sha256_hex(np.arange(4, dtype=np.int32)) == hashlib.sha256(np.arange(4, dtype=np.int32).tobytes()).hexdigest()


def test_ids_and_digest_agree_on_a_list_its_int64_bytes_and_an_array():
    """The record process gets a record's ids as their int64 bytes (``RecordProcess.send`` packs the scheduler's
    list): the ids and the digest it writes must be those of the list, which the driver proves against."""
    ids = [0, 5, 151_935, 2**40, 7]
    want_ids, want = ids_and_digest(ids)
    for form in (token_bytes(ids), np.array(ids, dtype=np.int64)):
        got_ids, got = ids_and_digest(form)
        assert got == want == token_digest(ids) and got_ids.dtype == np.dtype("<i8")
        assert got_ids.tolist() == want_ids.tolist() == ids
