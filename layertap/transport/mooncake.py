"""The ``mooncake`` transport: records through a Mooncake Store, across machines (TCP here, RDMA in production).

Opt-in network use: the consumer's Mooncake client mounts ``segment_bytes`` of its own memory into the
store (records land there), and every Mooncake client (consumer and sinks) opens transfer-engine
listeners; with ``local_hostname=127.0.0.1`` (the default) peers reach them only through loopback, but
Mooncake 0.3.13 binds them on all interfaces, so choose this backend only where that is acceptable.
The master must be started by you, e.g. ``mooncake_master --rpc_address=127.0.0.1 --rpc_port=50051
--metrics_host=127.0.0.1 --metrics_port=9003`` (its defaults bind 0.0.0.0).

Keys, under ``lt/<run>/`` (``run`` is made by ``prepare``)::

    alive                   put by the consumer; its absence means the master restarted and lost every key
    writer/<n>              writer n's identity (dense n; claimed first-come: Mooncake's put never overwrites)
    w<n>/hb                 heartbeat counter, upserted every ``heartbeat_s`` by the sink
    w<n>/<seq>/d            record payload (a ``records.serialize`` blob)
    w<n>/<seq>/m            manifest {key, length, crc32}: put last, its presence commits the record
    w<n>/closed             put by ``Sink.close``: no more records from writer n

Every object is hard-pinned (Mooncake evicts unpinned objects silently above ~90% full). A full store
(``NO_AVAILABLE_HANDLE``) is backpressure: ``put`` retries until ``put_timeout`` s, then raises
``StoreFull``. The consumer reads writers' sequences in order and removes each record's keys once it
has been delivered, so the store holds only what the consumer has not taken yet. Mooncake reports
errors as integer codes (and ``get`` of a missing key as ``b''``); ``check_rc`` maps every code to a
named exception, and empty reads are re-checked with ``is_exist``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from layertap.records import (
    IncompleteRecordError, IntegrityError, Record, deserialize, payload_checksum, serialize, to_record,
)
from layertap.transport.base import PeerGone, Sink, Source, Transport, TransportError, TransportFull, register

MAX_WRITERS = 256
DEFAULTS: dict[str, Any] = {
    "master": "127.0.0.1:50051", "metadata": "P2PHANDSHAKE", "protocol": "tcp", "rdma_devices": "",
    "local_hostname": "127.0.0.1", "segment_bytes": 1 << 30, "buffer_bytes": 256 << 20,
    "put_timeout": 60.0, "heartbeat_s": 1.0, "peer_timeout": 10.0, "poll_interval": 0.005,
}


class MooncakeError(TransportError):
    """A Mooncake call returned an error code; ``code`` and ``code_name`` say which."""

    def __init__(self, msg: str, code: int):
        super().__init__(msg)
        self.code, self.code_name = code, CODES.get(code, "UNKNOWN")


class StoreFull(MooncakeError, TransportFull):
    """The store has no room (NO_AVAILABLE_HANDLE / BUFFER_OVERFLOW) within the put timeout."""


class StoreGone(MooncakeError, PeerGone):
    """The master or a peer's transfer engine cannot be reached (RPC_FAIL, TRANSFER_FAIL, ...)."""


class RecordTooLarge(MooncakeError):
    """The record does not fit the client's local buffer (INVALID_PARAMS on put)."""


class KeyMissing(MooncakeError):
    """OBJECT_NOT_FOUND."""


CODES = {  # mooncake-store/include/types.h, ErrorCode
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -100: "SHARD_INDEX_OUT_OF_RANGE", -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS", -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION", -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE", -701: "INVALID_READ", -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -710: "REPLICA_NOT_FOUND", -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL", -900: "RPC_FAIL", -1000: "ETCD_OPERATION_ERROR", -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
_CLASSES: dict[int, type[MooncakeError]] = {
    -10: StoreFull, -200: StoreFull, -101: StoreGone, -103: StoreGone, -800: StoreGone, -900: StoreGone,
    -1010: StoreGone, -600: RecordTooLarge, -704: KeyMissing,
}


def check_rc(rc: int, what: str) -> int:
    """Return ``rc`` if >= 0, else raise the named exception for it (message: ``what`` + code name)."""
    if rc >= 0:
        return rc
    cls = _CLASSES.get(rc, MooncakeError)
    raise cls(f"{what}: Mooncake error {CODES.get(rc, 'UNKNOWN')} ({rc})", rc)


def connect(cfg: dict[str, Any], segment_bytes: int) -> Any:
    """A Mooncake Store client; ``segment_bytes`` of this process's memory is mounted into the store."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise TransportError("the mooncake transport needs `pip install mooncake-transfer-engine-non-cuda` "
                             "(CPU) or `mooncake-transfer-engine` (CUDA), and the system library libibverbs1") from e
    store = MooncakeDistributedStore()
    rc = store.setup(cfg["local_hostname"], cfg["metadata"], segment_bytes, cfg["buffer_bytes"], cfg["protocol"],
                     cfg["rdma_devices"], cfg["master"])
    if rc != 0:
        raise StoreGone(f"cannot connect to the Mooncake master at {cfg['master']} (setup returned {rc})", rc)
    return store


def _pinned() -> Any:
    from mooncake.store import ReplicateConfig

    rep = ReplicateConfig()
    rep.with_hard_pin = True  # never evicted: losing a record silently is not an option
    return rep


class MooncakeSink(Sink):
    """Producer side; one per vLLM worker. A heartbeat thread proves liveness to the consumer."""

    def __init__(self, config: dict[str, Any], writer_id: str):
        self.cfg = {**DEFAULTS, **config}
        self.ns = f"lt/{self.cfg['run']}"
        self.store = connect(self.cfg, 0)  # pure client: records land in the consumer's segment
        self.rep = _pinned()
        self.writer_id = writer_id
        self.n = self._register()
        self.seq = 0
        self._hb_error: BaseException | None = None
        self._stop = threading.Event()
        self._hb = threading.Thread(target=self._heartbeat, name=f"layertap-mooncake-hb-{self.n}", daemon=True)
        self._hb.start()

    def _register(self) -> int:
        me = json.dumps({"writer": self.writer_id, "host": socket.gethostname(), "pid": os.getpid(),
                         "nonce": uuid.uuid4().hex}).encode()
        for n in range(MAX_WRITERS):
            key = f"{self.ns}/writer/{n}"
            if check_rc(self.store.is_exist(key), f"registering writer {self.writer_id}") == 1:
                continue
            check_rc(self.store.put(key, me, self.rep), f"registering writer {self.writer_id}")
            if self.store.get(key) == me:  # put never overwrites: whoever reads back its own bytes won
                return n
        raise TransportError(f"no free writer number under {self.ns} (max {MAX_WRITERS})")

    def _heartbeat(self) -> None:
        beats = 0
        while not self._stop.wait(self.cfg["heartbeat_s"]):
            beats += 1
            rc = self.store.upsert(f"{self.ns}/w{self.n}/hb", str(beats).encode(), self.rep)
            if rc < 0:
                try:
                    check_rc(rc, f"heartbeat of writer {self.writer_id}")
                except MooncakeError as e:
                    self._hb_error = e  # surfaced by the next put
                return

    def _put_retrying(self, key: str, value: bytes | bytearray, record: str) -> None:
        deadline = time.monotonic() + self.cfg["put_timeout"]
        delay = 0.001
        while True:
            try:
                check_rc(self.store.put(key, value, self.rep), f"putting record {record}")
                return
            except StoreFull:
                if time.monotonic() >= deadline:
                    raise StoreFull(f"Mooncake store full for {self.cfg['put_timeout']} s; record {record} "
                                    f"not committed (consumer not keeping up)", -200) from None
            time.sleep(delay)  # wait for the consumer to take (and remove) records
            delay = min(delay * 2, 0.05)

    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Payload, then manifest; raises ``StoreFull``, ``StoreGone``, ``RecordTooLarge`` naming ``key``."""
        if self._hb_error is not None:
            raise StoreGone(f"record {key} not committed: {self._hb_error}", self._hb_error.code)
        blob = serialize(tensors, meta)
        if len(blob) > self.cfg["buffer_bytes"]:
            raise RecordTooLarge(f"record {key} is {len(blob)} bytes; raise buffer_bytes "
                                 f"({self.cfg['buffer_bytes']})", -600)
        base = f"{self.ns}/w{self.n}/{self.seq}"
        manifest = json.dumps({"key": key, "length": len(blob), "crc32": payload_checksum(blob)}).encode()
        self._put_retrying(f"{base}/d", blob, key)
        try:
            self._put_retrying(f"{base}/m", manifest, key)
        except MooncakeError:
            self.store.remove(f"{base}/d", True)  # best effort: the payload alone is never delivered
            raise
        self.seq += 1

    def close(self) -> None:
        self._stop.set()
        self._hb.join(5)
        rc = self.store.put(f"{self.ns}/w{self.n}/closed", str(self.seq).encode(), self.rep)
        self.store.close()
        check_rc(rc, f"closing writer {self.writer_id}")


@dataclass
class _Writer:
    n: int
    name: str
    next_seq: int = 0
    beat: bytes = b""
    beat_at: float = 0.0
    done: bool = False


class MooncakeSource(Source):
    """Consumer side: mounts the storage, discovers writers, delivers each writer's records in order."""

    def __init__(self, config: dict[str, Any]):
        self.cfg = {**DEFAULTS, **config}
        self.ns = f"lt/{self.cfg['run']}"
        self.store = connect(self.cfg, self.cfg["segment_bytes"])
        self.rep = _pinned()
        check_rc(self.store.put(f"{self.ns}/alive", b"1", self.rep), "marking the run alive")
        self.writers: list[_Writer] = []
        self._seen: set[str] = set()
        self._next_liveness = 0.0

    def _get(self, key: str, record: str) -> bytes:
        data = self.store.get(key)
        if not data:  # Mooncake returns b'' for a missing key *and* for a dead master: ask which
            check_rc(self.store.is_exist(key), f"reading record {record}")
            raise IncompleteRecordError(f"record {record}: {key} is missing or empty in the store")
        return data

    def _fetch(self, w: _Writer) -> Record:
        base = f"{self.ns}/w{w.n}/{w.next_seq}"
        man = json.loads(self._get(f"{base}/m", f"{w.name}#{w.next_seq}"))
        key = man["key"]
        try:
            blob = self._get(f"{base}/d", key)
        finally:  # a record fails once, by name; it is never retried (nor re-raised on every poll)
            w.next_seq += 1
            for k in (f"{base}/d", f"{base}/m"):
                rc = self.store.remove(k, True)  # force: our get left a lease on it
                if rc != -704:  # an already missing payload was reported above
                    check_rc(rc, f"removing record {key}")
        if len(blob) != man["length"]:
            raise IncompleteRecordError(f"record {key}: payload is {len(blob)} bytes, manifest says {man['length']}")
        if payload_checksum(blob) != man["crc32"]:
            raise IntegrityError(f"record {key}: payload checksum mismatch")
        if key in self._seen:
            raise TransportError(f"record {key} was committed twice (writer {w.name})")
        self._seen.add(key)
        return to_record(*deserialize(blob))

    def _scan(self) -> list[_Writer]:
        """One batched existence check: run marker, next writer slot, each writer's next manifest."""
        live = [w for w in self.writers if not w.done]
        keys = [f"{self.ns}/alive", f"{self.ns}/writer/{len(self.writers)}"]
        keys += [f"{self.ns}/w{w.n}/{w.next_seq}/m" for w in live]
        found = self.store.batch_is_exist(keys)
        for k, rc in zip(keys, found):
            check_rc(rc, f"polling {k}")
        if found[0] != 1:
            raise StoreGone(f"Mooncake master at {self.cfg['master']} lost run {self.ns} (restarted?); records "
                            f"in flight are lost", -704)
        if found[1] == 1:
            info = json.loads(self._get(keys[1], "writer registration"))
            self.writers.append(_Writer(len(self.writers), f"{info['writer']}@{info['host']}:{info['pid']}",
                                        beat_at=time.monotonic()))
        return [w for w, ok in zip(live, found[2:]) if ok == 1]

    def _check_writers(self) -> None:
        now = time.monotonic()
        for w in self.writers:
            if w.done:
                continue
            beat = self.store.get(f"{self.ns}/w{w.n}/hb")
            if beat != w.beat:
                w.beat, w.beat_at = beat, now
                continue
            if check_rc(self.store.is_exist(f"{self.ns}/w{w.n}/closed"), "polling writers") == 1:
                w.done = check_rc(self.store.is_exist(f"{self.ns}/w{w.n}/{w.next_seq}/m"), "polling") == 0
            elif now - w.beat_at > self.cfg["peer_timeout"]:
                w.done = True
                self.store.remove(f"{self.ns}/w{w.n}/{w.next_seq}/d", True)  # a half-put payload, if any
                raise StoreGone(f"writer {w.name} stopped heart-beating {self.cfg['peer_timeout']} s ago (dead?); "
                                f"records after #{w.next_seq} from it are lost", -900)

    def poll(self, timeout: float = 0.0) -> list[Record]:
        deadline = time.monotonic() + timeout
        while True:
            ready = self._scan()
            if ready:
                return [self._fetch(w) for w in ready]
            now = time.monotonic()
            if now >= self._next_liveness:
                self._next_liveness = now + self.cfg["heartbeat_s"]
                self._check_writers()
            if now >= deadline:
                return []
            time.sleep(min(self.cfg["poll_interval"], deadline - now))

    def close(self) -> None:
        self.store.remove_by_regex(f"^{self.ns}/", True)
        self.store.close()


@register
class MooncakeTransport(Transport):
    name = "mooncake"

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("mooncake transport (network; opt-in)")
        g.add_argument("--mooncake-master", default=DEFAULTS["master"], help="host:port of a running mooncake_master")
        g.add_argument("--mooncake-protocol", default="tcp", choices=["tcp", "rdma"], help="transfer protocol")
        g.add_argument("--mooncake-rdma-devices", default="", help="RDMA devices, e.g. mlx5_0 (rdma only)")
        g.add_argument("--mooncake-local-hostname", default="127.0.0.1",
                       help="address peers use to reach this process; set it to a routable address to go across machines")
        g.add_argument("--mooncake-segment-mb", type=int, default=1024,
                       help="memory the consumer mounts into the store: the bound on records in flight (default 1024)")
        g.add_argument("--mooncake-buffer-mb", type=int, default=256, help="per-client buffer; must exceed the largest record")
        g.add_argument("--mooncake-put-timeout", type=float, default=60.0, help="seconds a put waits on a full store")

    @classmethod
    def config_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {"master": args.mooncake_master, "protocol": args.mooncake_protocol,
                "rdma_devices": args.mooncake_rdma_devices, "local_hostname": args.mooncake_local_hostname,
                "segment_bytes": args.mooncake_segment_mb << 20, "buffer_bytes": args.mooncake_buffer_mb << 20,
                "put_timeout": args.mooncake_put_timeout}

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        return {**DEFAULTS, **config, "run": config.get("run") or uuid.uuid4().hex[:12]}

    @classmethod
    def make_sink(cls, config: dict[str, Any], writer_id: str) -> Sink:
        return MooncakeSink(config, writer_id)

    @classmethod
    def make_source(cls, config: dict[str, Any]) -> Source:
        return MooncakeSource(config)
