"""The transport interface and its registry.

A transport moves serialized records (``records.serialize``) from a *sink* that lives in the vLLM worker
process to a *source* that lives in the consumer. Contract, every backend:

- ``Sink.put(key, tensors, meta)`` commits the record atomically or raises ``TransportError``: payload
  first, manifest last; a consumer never sees a record whose payload is incomplete.
- ``Source.poll(timeout)`` returns records committed since the last call, each key exactly once, each
  checked (checksum + token digest) before it is handed out.
- ``Source.free_capacity()`` says how many more records may be put without blocking (``None`` =
  unbounded), so producers can bound in-flight work instead of dropping or growing.
- Nothing listens beyond loopback unless a backend's config says so explicitly.

Backends register under a name; ``get_transport(name)`` imports the module on first use so optional
dependencies (Mooncake) are only needed when chosen.
"""

from __future__ import annotations

import argparse
import importlib
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from layertap.records import Record


class TransportError(RuntimeError):
    """A transport failed; the message names the record or peer."""


class TransportFull(TransportError):
    """No capacity left within the configured bound (backpressure, not data loss)."""


class PeerGone(TransportError):
    """The other side (consumer, producer or store) died or vanished."""


class Sink(ABC):
    """Producer side; created inside the vLLM worker from a plain-dict config."""

    @abstractmethod
    def put(self, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None: ...

    def reserve(self, key: str, specs: dict[str, Any], meta: dict[str, Any], *,
                template: Any = None) -> "Reservation | None":
        """Lay a record out in transport memory *now*, without waiting, for the producer to fill in place
        (``specs``: name -> tensor or ``(dtype, shape)``; ``template``: a ``records.MetaTemplate`` whose fields
        the manifest holds too, under ``meta``'s). ``None`` when the backend cannot (or has no room right now);
        the producer then builds the tensors itself and calls ``put``."""
        return None

    def flush(self) -> None:  # noqa: B027 - optional
        """Block until everything put so far is committed."""

    def close(self) -> None:  # noqa: B027 - optional
        pass


class Reservation(ABC):
    """A record laid out in transport memory: write into ``tensors``, then ``commit()`` exactly once, or
    ``abort()``. Until ``commit`` no consumer can see it; after ``abort`` its memory is free again."""

    key: str
    tensors: dict[str, torch.Tensor]

    @abstractmethod
    def commit(self) -> None: ...

    @abstractmethod
    def abort(self) -> None: ...


class Source(ABC):
    """Consumer side."""

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> list[Record]: ...

    def free_capacity(self) -> int | None:
        return None

    def close(self) -> None:  # noqa: B027 - optional
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Transport(ABC):
    """A backend: owns its CLI flags, its config dict, and builds sinks and sources."""

    name: ClassVar[str]

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:  # noqa: B027 - optional
        """Add this backend's own flags (prefixed with the backend name)."""

    @classmethod
    def config_from_args(cls, args: argparse.Namespace) -> dict[str, Any]:
        return {}

    @classmethod
    @abstractmethod
    def make_sink(cls, config: dict[str, Any], writer_id: str) -> Sink: ...

    @classmethod
    @abstractmethod
    def make_source(cls, config: dict[str, Any]) -> Source: ...

    @classmethod
    def prepare(cls, config: dict[str, Any]) -> dict[str, Any]:
        """Consumer-side set-up before the engine starts (create pools, check paths); returns the
        config the sink will receive (must be JSON-serializable: it crosses into the worker)."""
        return config

    @classmethod
    def cleanup(cls, config: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Free what ``prepare`` created."""


_MODULES = {
    "file": "layertap.transport.file",
    "shm": "layertap.transport.shm",
    "mooncake": "layertap.transport.mooncake",
}
_REGISTRY: dict[str, type[Transport]] = {}


def register(cls: type[Transport]) -> type[Transport]:
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    return sorted(_MODULES)


def get_transport(name: str) -> type[Transport]:
    if name not in _REGISTRY:
        if name not in _MODULES:
            raise ValueError(f"unknown transport {name!r}; expected one of {available()}")
        importlib.import_module(_MODULES[name])
    return _REGISTRY[name]
