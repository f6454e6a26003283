"""The ``file`` transport: a dataset on disk, sharded, memory-mapped, random access.

Layout of a dataset directory::

    dataset.json                 run-level manifest (model, layer ids, semantics, vLLM version, ...)
    shard-<writer>-<n>.bin       concatenated record blobs (each a safetensors blob)
    index-<writer>.jsonl         one line per committed record: key, index, shard, offset, length, crc32

Commit protocol: the blob is appended to the shard and flushed (``fdatasync`` when ``fsync``), then
one index line is appended with a single ``write`` on an ``O_APPEND`` descriptor. The line is the
commit point. A crash before it leaves bytes in the shard that no index line points to (invisible);
a torn line has no trailing newline or fails to parse, and readers ignore it. Each writer (one per
vLLM worker process) owns its own shard and index files, so writers never interleave.
"""

from __future__ import annotations

import argparse
import errno
import json
import mmap
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from layertap.records import (
    IncompleteRecordError,
    IntegrityError,
    Record,
    deserialize,
    payload_checksum,
    serialize,
    to_record,
)
from layertap.transport.base import Sink, Source, Transport, TransportError, register

DEFAULT_SHARD_BYTES = 1 << 30


class DiskFullError(TransportError):
    """The output file system is out of space; the record was not committed."""


def writer_name(writer_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in writer_id)
    return safe or "w"


class FileSink(Sink):
    def __init__(self, root: str | os.PathLike, writer_id: str, *, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 fsync: bool = True):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer = writer_name(writer_id)
        self.shard_bytes = shard_bytes
        self.fsync = fsync
        self._shard_no = self._next_shard_no()
        self._shard = None
        self._shard_name = ""
        index = self.root / f"index-{self.writer}.jsonl"
        self._index_fd = os.open(index, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        with open(index, "rb") as f:  # a torn last line (crash mid-commit) must not swallow our first line
            f.seek(0, os.SEEK_END)
            if f.tell() and (f.seek(-1, os.SEEK_END) or True) and f.read(1) != b"\n":
                os.write(self._index_fd, b"\n")

    def _next_shard_no(self) -> int:
        existing = [p.name for p in self.root.glob(f"shard-{self.writer}-*.bin")]
        nums = [int(n.rsplit("-", 1)[1].split(".")[0]) for n in existing]
        return max(nums, default=-1) + 1

    def _open_shard(self) -> None:
        if self._shard is not None:
            self._shard.close()
        self._shard_name = f"shard-{self.writer}-{self._shard_no:05d}.bin"
        self._shard_no += 1
        self._shard = open(self.root / self._shard_name, "ab")

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        blob = serialize(tensors, meta)
        if self._shard is None or self._shard.tell() + len(blob) > self.shard_bytes and self._shard.tell() > 0:
            self._open_shard()
        offset = self._shard.tell()
        try:
            self._shard.write(blob)
            self._shard.flush()
            if self.fsync:
                os.fdatasync(self._shard.fileno())
            line = json.dumps({
                "key": key, "index": meta.get("index"), "shard": self._shard_name, "offset": offset,
                "length": len(blob), "crc32": payload_checksum(blob), "num_tokens": meta.get("num_tokens"),
            }, separators=(",", ":")) + "\n"
            os.write(self._index_fd, line.encode())  # the commit point
            if self.fsync:
                os.fdatasync(self._index_fd)
        except OSError as e:
            # Drop the partial tail so later records are not written after garbage we cannot explain.
            try:
                self._shard.truncate(offset)
                self._shard.seek(offset)
            except OSError:
                pass
            if e.errno == errno.ENOSPC:
                raise DiskFullError(f"disk full under {self.root} while writing record {key}; not committed") from e
            raise TransportError(f"writing record {key} to {self.root} failed: {e}") from e

    def close(self) -> None:
        if self._shard is not None:
            self._shard.close()
            self._shard = None
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1


def _parse_index_line(line: bytes) -> dict[str, Any] | None:
    if not line.endswith(b"\n"):
        return None  # torn write: not committed
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class FileDataset:
    """Random access over a dataset directory; tensors are views of memory-mapped shards."""

    def __init__(self, root: str | os.PathLike, *, verify_checksum: bool = True):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"no dataset directory at {self.root}")
        self.verify_checksum = verify_checksum
        self._maps: dict[str, mmap.mmap] = {}
        self.entries: list[dict[str, Any]] = []
        seen: set[str] = set()
        for idx in sorted(self.root.glob("index-*.jsonl")):
            with open(idx, "rb") as f:
                for line in f:
                    e = _parse_index_line(line)
                    if e is not None and e["key"] not in seen:
                        seen.add(e["key"])
                        self.entries.append(e)
        self.entries.sort(key=lambda e: (e["index"] if e["index"] is not None else -1, e["key"]))

    @property
    def manifest(self) -> dict[str, Any]:
        p = self.root / "dataset.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def __len__(self) -> int:
        return len(self.entries)

    def _map(self, shard: str) -> mmap.mmap:
        m = self._maps.get(shard)
        if m is None:
            with open(self.root / shard, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[shard] = m
        return m

    def read_entry(self, e: dict[str, Any]) -> Record:
        m = self._map(e["shard"])
        end = e["offset"] + e["length"]
        if end > len(m):  # the shard grew since it was mapped
            self._maps.pop(e["shard"])  # older records may still view the old map; it closes when unused
            m = self._map(e["shard"])
            if end > len(m):
                raise IncompleteRecordError(f"record {e['key']}: shard {e['shard']} ends before byte {end}")
        view = memoryview(m)[e["offset"] : end]
        if self.verify_checksum and payload_checksum(view) != e["crc32"]:
            raise IntegrityError(f"record {e['key']}: payload checksum mismatch in {e['shard']}@{e['offset']}")
        tensors, meta = deserialize(view)
        return to_record(tensors, meta)

    def __getitem__(self, i: int) -> Record:
        return self.read_entry(self.entries[i])

    def __iter__(self) -> Iterator[Record]:
        for e in self.entries:
            yield self.read_entry(e)

    def committed_indices(self) -> set[int]:
        return {e["index"] for e in self.entries if e["index"] is not None}


class FileSource(Source):
    """Tails the index files of a dataset directory; yields each newly committed record once."""

    def __init__(self, root: str | os.PathLike, *, verify_checksum: bool = True):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._ds = FileDataset.__new__(FileDataset)
        self._ds.root, self._ds.verify_checksum, self._ds._maps, self._ds.entries = self.root, verify_checksum, {}, []
        self._pos: dict[Path, int] = {}
        self._seen: set[str] = set()

    def skip_existing(self) -> set[int]:
        """Mark every record already committed as seen; returns their input indices (for resume)."""
        done = set()
        for e in self._new_entries():
            done.add(e["index"])
        return done

    def _new_entries(self) -> list[dict[str, Any]]:
        out = []
        for idx in sorted(self.root.glob("index-*.jsonl")):
            pos = self._pos.get(idx, 0)
            with open(idx, "rb") as f:
                f.seek(pos)
                data = f.read()
            lines = data.split(b"\n")
            consumed = 0
            for raw in lines[:-1]:  # the last piece has no newline yet: not committed
                consumed += len(raw) + 1
                e = _parse_index_line(raw + b"\n")
                if e is not None and e["key"] not in self._seen:
                    self._seen.add(e["key"])
                    out.append(e)
            self._pos[idx] = pos + consumed
        return out

    def poll(self, timeout: float = 0.0) -> list[Record]:
        deadline = time.monotonic() + timeout
        while True:
            entries = self._new_entries()
            if entries or time.monotonic() >= deadline:
                return [self._ds.read_entry(e) for e in entries]
            time.sleep(min(0.005, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        for m in self._ds._maps.values():
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a tensor view; the map closes when it is collected
        self._ds._maps.clear()


@register
class FileTransport(Transport):
    name = "file"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("file transport")
        g.add_argument("--file-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
                       help="rotate to a new shard file after this many bytes (default 1 GiB)")
        g.add_argument("--file-no-fsync", action="store_true",
                       help="skip fdatasync per record (faster; a machine crash may lose recent records)")

    @classmethod
    def config_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"shard_bytes": args.file_shard_bytes, "fsync": not args.file_no_fsync}

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        root = Path(config["path"])
        try:
            root.mkdir(parents=True, exist_ok=True)
            probe = root / f".probe-{socket.gethostname()}-{os.getpid()}"
            probe.write_bytes(b"x")
            probe.unlink()
        except OSError as e:
            raise TransportError(f"output directory {root} is not writable: {e}") from e
        return {**config, "path": str(root.resolve())}

    @classmethod
    def make_sink(cls, config: dict[str, Any], writer_id: str) -> Sink:
        return FileSink(config["path"], writer_id, shard_bytes=int(config.get("shard_bytes", DEFAULT_SHARD_BYTES)),
                        fsync=bool(config.get("fsync", True)))

    @classmethod
    def make_source(cls, config: dict[str, Any]) -> Source:
        return FileSource(config["path"])


def load_records(path: str | os.PathLike) -> FileDataset:
    """Open a dataset directory written by ``capture --out`` (random access, iterable)."""
    return FileDataset(path)
