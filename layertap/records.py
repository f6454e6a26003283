"""Records: what one captured request becomes, and how it is serialized.

A record is a set of named tensors plus a JSON manifest. It is produced inside the vLLM worker
process (``engine/connector.py``), moved by a transport (``transport/``), and handed to consumers as a
``Record``. The serialized form is a safetensors blob (header + raw tensor bytes), so any transport
can move it as bytes and any reader can map it without a copy.

Layer semantics (the convention every record states in its manifest):
    layer id ``i`` is the residual stream *entering* decoder layer ``i`` (hidden + residual); id 0 is the
    embedding output; id ``N = num_hidden_layers`` is the last layer's output *before* the final norm.
    HF ``output_hidden_states[i]`` equals id ``i`` for ``i < N``; HF's last entry is *after* the norm.

Row alignment:
    row ``t`` of ``hidden_states`` belongs to ``token_ids[t]`` at position ``t``: it is the state the
    model computed *for* that input token (used to predict token ``t + 1``). In ``generate`` mode the
    final sampled token never ran through the model, so it has no row: ``token_ids`` holds the
    ``num_prompt_tokens + num_generated - 1`` tokens that ran, and ``meta["next_token_id"]`` the last one.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import struct
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

LAYER_SEMANTICS = (
    "id i = residual stream entering decoder layer i (hidden+residual); id 0 = embedding output; "
    "id num_hidden_layers = last layer output before the final norm"
)
FORMAT_VERSION = 1


class RecordError(Exception):
    """Base class of record integrity errors; the message names the record."""


class IntegrityError(RecordError):
    """A checksum or digest does not match what the manifest promised."""


class IncompleteRecordError(RecordError):
    """A record's payload is missing or shorter than its manifest says."""


def token_bytes(token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Token ids (Python ints) as little-endian int64 bytes. ``struct`` converts 1024 ids in ~9 us where
    ``np.fromiter`` / ``np.asarray`` take 18-22 (2-core box): the engine's scheduler and the driver convert
    every record's tokens once."""
    return struct.pack(f"<{len(token_ids)}q", *token_ids)


_HASH_CHUNK = 2047
"""hashlib lets go of the GIL while it hashes 2048 bytes or more at once. A 1024-token record's ids are 8 KiB,
hashed in ~7 us; getting the GIL back afterwards can take a switch interval (5 ms) whenever another thread of
the process has Python to run (``benchmarks/gil_release_cost.py``). So the digests on the engine's scheduler
step and the driver's loop are fed in pieces below that size and keep the GIL: ~3 us more, no hand-off."""


def ids_and_digest(token_ids: list[int] | np.ndarray | bytes) -> tuple[np.ndarray, str]:
    """A record's token ids as int64 (little-endian) and their sha256, from one conversion: what the writer of a
    record (the engine's worker, or its record process) puts in the record's field and its manifest."""
    if isinstance(token_ids, np.ndarray):
        raw = np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
    elif isinstance(token_ids, bytes):  # already little-endian int64 (the record process's hand-over)
        raw = token_ids
    else:
        raw = token_bytes(token_ids)
    return np.frombuffer(raw, dtype="<i8"), sha256_hex(raw)


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """``hashlib.sha256(data).hexdigest()`` without releasing the GIL (see ``_HASH_CHUNK``)."""
    h = hashlib.sha256()
    mv = memoryview(data).cast("B")
    for i in range(0, len(mv), _HASH_CHUNK):
        h.update(mv[i:i + _HASH_CHUNK])
    return h.hexdigest()


def token_digest(token_ids: torch.Tensor | list[int] | np.ndarray) -> str:
    """sha256 of the token ids as little-endian int64: the proof a record belongs to its request."""
    if isinstance(token_ids, (list, tuple)):
        return sha256_hex(token_bytes(token_ids))
    arr = np.asarray(token_ids.cpu() if isinstance(token_ids, torch.Tensor) else token_ids, dtype="<i8")
    return sha256_hex(np.ascontiguousarray(arr))


def payload_checksum(buf: bytes | memoryview) -> str:
    """Cheap integrity checksum of a serialized payload (crc32, hex)."""
    return f"{zlib.crc32(buf) & 0xFFFFFFFF:08x}"


@dataclass
class Record:
    """One request's captured hidden states.

    ``hidden_states`` is ``[num_tokens, num_layers, hidden_size]``; plane ``j`` is layer ``layer_ids[j]``.
    """

    index: int
    """0-based position of the input (line of the input file, or position in the ``inputs`` list)."""
    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    layer_ids: list[int]
    num_prompt_tokens: int
    loss_mask: torch.Tensor | None = None
    """Per-token 0/1 mask of assistant (trainable) tokens, when the input was a conversation."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Manifest fields: model, config_hash, vllm_version, dtype, mode, layer_semantics, token_digest..."""
    positions: torch.Tensor | None = None
    """int64 positions (into ``token_ids``) of the rows of ``hidden_states`` when only some rows were kept
    (``transport.compact`` with ``only_loss_masked``); ``None`` means row ``t`` is token ``t``."""
    # --- transport hook (owned by transport/): frees the buffer the tensors view (e.g. a shm slot) ---
    _release: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    _digest: tuple[Any, str] | None = field(default=None, repr=False, compare=False)  # check(): (token_ids, digest)

    def checked_digest(self) -> str:
        """The digest of ``token_ids``: the one ``check()`` computed and found equal to the manifest's (the
        transports check every record they deliver), unless ``token_ids`` was replaced since; else computed now."""
        if self._digest is not None and self._digest[0] is self.token_ids:
            return self._digest[1]
        return token_digest(self.token_ids)

    def release(self) -> None:
        """Give the buffer this record's tensors view back to its transport (idempotent). The tensors
        must not be used afterwards; records without a transport buffer ignore this."""
        fn, self._release = self._release, None
        if fn is not None:
            fn()

    def __enter__(self) -> "Record":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def key(self) -> str:
        return str(self.meta.get("key", self.index))

    @property
    def mode(self) -> str:
        return str(self.meta.get("mode", "prompt"))

    def check(self) -> None:
        """Raise ``IntegrityError`` unless shapes and the token digest agree with the manifest."""
        n = int(self.token_ids.shape[0])
        if self.positions is not None:
            self._check_positions(n)
            n = int(self.positions.shape[0])
        if self.hidden_states.dim() != 3 or self.hidden_states.shape[0] != n:
            raise IntegrityError(
                f"record {self.key}: hidden_states shape {tuple(self.hidden_states.shape)} does not match "
                f"{n} token ids" + ("" if self.positions is None else " (kept positions)")
            )
        if self.hidden_states.shape[1] != len(self.layer_ids):
            raise IntegrityError(
                f"record {self.key}: {self.hidden_states.shape[1]} planes but layer_ids={self.layer_ids}"
            )
        want = self.meta.get("token_digest")
        if want is not None:
            got = token_digest(self.token_ids)
            if got != want:
                raise IntegrityError(f"record {self.key}: token-id digest mismatch (payload does not belong to it)")
            self._digest = (self.token_ids, got)

    def _check_positions(self, num_tokens: int) -> None:
        p = self.positions
        if p is None:
            return
        if p.dim() != 1 or p.dtype != torch.int64:
            raise IntegrityError(f"record {self.key}: positions must be 1-D int64, got {p.dtype} {tuple(p.shape)}")
        if p.numel() and (int(p[0]) < 0 or int(p[-1]) >= num_tokens or bool((p[1:] <= p[:-1]).any())):
            raise IntegrityError(
                f"record {self.key}: positions must be strictly increasing within [0, {num_tokens})"
            )


# ---------------------------------------------------------------------------------------------
# Serialization: a safetensors blob, parsed here without a copy (works on mmap / shared memory).
# ---------------------------------------------------------------------------------------------

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


TensorSpec = tuple[torch.dtype, tuple[int, ...]]
"""(dtype, shape) of a tensor that will be written into a reserved record (``layout``)."""


def _spec(t: torch.Tensor | TensorSpec) -> TensorSpec:
    return (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else (t[0], tuple(t[1]))


@functools.lru_cache(maxsize=64)
def _json_key(name: str) -> str:
    return json.dumps(name)


_encode_str = json.encoder.encode_basestring_ascii  # what json.dumps does to a str (ensure_ascii): C, ~0.2 us


def _encode_value(v: Any) -> str:
    """``json.dumps(v, sort_keys=True)``, the same characters, with the common scalar types written directly
    (each ``json.dumps`` call costs ~1.5 us of set-up; a record's manifest has a dozen fields)."""
    t = type(v)
    if t is str:
        return _encode_str(v)
    if t is int:
        return int.__repr__(v)
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    return json.dumps(v, sort_keys=True)


class MetaTemplate:
    """Manifest fields that many records share (the model, layer ids, the layer semantics, ...), JSON-encoded
    once: ``layout(specs, fields, template=t)`` writes the same bytes as ``layout(specs, {**t.fields, **fields})``
    and encodes only the record's own fields (tests/unit/test_records.py checks the bytes). A snapshot: changing
    the dict it was made from afterwards does not change it."""

    __slots__ = ("fields", "_items")

    def __init__(self, fields: dict[str, Any]):
        if not all(type(k) is str for k in fields):
            raise TypeError("a template's field names must be str")
        self.fields = json.loads(json.dumps(fields))  # its own copy, as the consumer will read it
        self._items = {k: f"{_encode_str(k)}: {_encode_value(v)}" for k, v in fields.items()}

    def encode(self, fields: dict[str, Any]) -> str:
        """The manifest ``{**self.fields, **fields}`` as ``json.dumps(..., sort_keys=True)`` writes it."""
        items = dict(self._items)
        for k, v in fields.items():
            if type(k) is not str:  # json's own rules for other keys (coerced, then sorted)
                return json.dumps({**self.fields, **fields}, sort_keys=True)
            items[k] = f"{_encode_str(k)}: {_encode_value(v)}"
        return "{" + ", ".join([items[k] for k in sorted(items)]) + "}"


@functools.lru_cache(maxsize=256)
def _tensor_part(specs: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
                 ) -> tuple[str, tuple[tuple[str, int, int], ...], int]:
    """The header's tensor entries for these (name, dtype, shape) specs, each tensor's (start, nbytes) within the
    data section and the section's size. Cached: a producer's records repeat a few shapes."""
    off, parts, spans = 0, [], []
    for name, dtype, shape in specs:
        nbytes = math.prod(int(d) for d in shape) * dtype.itemsize
        dims = ",".join(str(int(d)) for d in shape)
        parts.append(f',{_json_key(name)}:{{"dtype":"{_NAMES[dtype]}","shape":[{dims}],'
                     f'"data_offsets":[{off},{off + nbytes}]}}')
        spans.append((name, off, nbytes))
        off += nbytes
    return "".join(parts), tuple(spans), off


def layout(tensors: dict[str, torch.Tensor | TensorSpec], meta: dict[str, Any],
           template: MetaTemplate | None = None) -> tuple[bytes, dict[str, tuple[int, int]], int]:
    """The blob's prefix (length + header), each tensor's (start, nbytes) within the blob, and its total size.

    Takes tensors or bare ``(dtype, shape)`` specs, so a producer can lay a record out before its data
    exists and have the data written straight into place (``transport.shm`` reservations). ``template``: the
    manifest is ``{**template.fields, **meta}``, its shared fields encoded once (``MetaTemplate``).

    Runs per record on the engine's step thread, so the header's JSON is written by hand (the same bytes
    as ``json.dumps(header, separators=(",", ":"))``, checked in tests/unit/test_records.py), not through
    a dict: the manifest's fields one by one, the tensor entries cached by shape (32 -> ~10 us a record on
    the 2-core box)."""
    inner = (template or _NO_TEMPLATE).encode(meta)
    tpart, tspans, data = _tensor_part(tuple((name, *_spec(t)) for name, t in tensors.items()))
    raw = ('{"__metadata__":{"layertap":' + _encode_str(inner) + "}" + tpart + "}").encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte alignment of the data section, as safetensors does
    prefix = struct.pack("<Q", len(raw)) + raw
    base = len(prefix)
    return prefix, {name: (base + a, n) for name, a, n in tspans}, base + data


_NO_TEMPLATE = MetaTemplate({})


def serialized_size(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
    return layout(tensors, meta)[2]


def serialize_into(buf: memoryview, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
    """Write the blob into ``buf`` (e.g. a shared-memory slot); returns the bytes written."""
    prefix, spans, total = layout(tensors, meta)
    if total > len(buf):
        raise ValueError(f"record needs {total} bytes but the buffer holds {len(buf)}")
    buf[: len(prefix)] = prefix
    for name, t in tensors.items():
        pos, nbytes = spans[name]
        if nbytes:
            src = t.detach().contiguous().view(-1).view(torch.uint8)
            if src.device.type == "cpu":  # numpy's copy is a plain memcpy: ~13 GB/s vs ~1.5 for torch's here
                np.copyto(np.frombuffer(buf[pos : pos + nbytes], dtype=np.uint8), src.numpy())
            else:
                torch.frombuffer(buf[pos : pos + nbytes], dtype=torch.uint8).copy_(src)
    return total


def serialize(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> bytearray:
    out = bytearray(serialized_size(tensors, meta))
    serialize_into(memoryview(out), tensors, meta)
    return out


def _typed_view(mv: memoryview, dtype: torch.dtype, start: int, stop: int) -> torch.Tensor:
    """A 1-D ``dtype`` tensor viewing ``mv[start:stop]`` (no copy; one torch call). torch warns on a read-only
    buffer; records are never written in place, so that warning is silenced, and only there (the guard costs
    ~1 us a tensor: the shm pool is writable)."""
    count, rest = divmod(stop - start, dtype.itemsize)
    if rest:
        raise IncompleteRecordError(f"a {dtype} tensor of {stop - start} bytes is not a whole number of elements")
    if not mv.readonly:
        return torch.frombuffer(mv, dtype=dtype, count=count, offset=start)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=dtype, count=count, offset=start)


def deserialize(buf: bytes | bytearray | memoryview) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parse a blob; tensors view ``buf`` (no copy). Raises ``IncompleteRecordError`` on a short buffer."""
    mv = memoryview(buf)
    if len(mv) < 8:
        raise IncompleteRecordError(f"payload of {len(mv)} bytes is shorter than a header")
    (hlen,) = struct.unpack("<Q", mv[:8])
    if 8 + hlen > len(mv):
        raise IncompleteRecordError(f"header of {hlen} bytes runs past a payload of {len(mv)} bytes")
    hdr = json.loads(bytes(mv[8 : 8 + hlen]))
    meta = json.loads(hdr.pop("__metadata__", {}).get("layertap", "{}"))
    base = 8 + hlen
    tensors = {}
    for name, info in hdr.items():
        a, b = info["data_offsets"]
        if base + b > len(mv):
            raise IncompleteRecordError(f"tensor {name!r} runs past the payload ({base + b} > {len(mv)})")
        dtype = _DTYPES[info["dtype"]]
        if b > a:
            t = _typed_view(mv, dtype, base + a, base + b)
        else:
            t = torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(info["shape"])
    return tensors, meta


def to_record(tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, check: bool = True) -> Record:
    """Build a ``Record`` from deserialized parts (dequantizing fp8 payloads) and check its digest."""
    hs = tensors["hidden_states"]
    if "hidden_scale" in tensors:  # fp8 e4m3 with a per-record scale
        hs = hs.to(torch.float32) * tensors["hidden_scale"].to(torch.float32)
    rec = Record(
        index=int(meta["index"]),
        token_ids=tensors["token_ids"],
        hidden_states=hs,
        layer_ids=[int(i) for i in meta["layer_ids"]],
        num_prompt_tokens=int(meta.get("num_prompt_tokens", tensors["token_ids"].shape[0])),
        loss_mask=tensors.get("loss_mask"),
        meta=meta,
        positions=tensors.get("positions"),
    )
    if check:
        rec.check()
    return rec


def record_tensors(rec: Record) -> dict[str, torch.Tensor]:
    out = {"token_ids": rec.token_ids.to(torch.int64), "hidden_states": rec.hidden_states}
    if rec.loss_mask is not None:
        out["loss_mask"] = rec.loss_mask.to(torch.uint8)
    if rec.positions is not None:
        out["positions"] = rec.positions.to(torch.int64)
    return out
