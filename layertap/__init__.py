"""layertap: per-request hidden states from a live vLLM engine, proven against a reference.

``Tap`` (imports vLLM) and ``load_records`` (does not) are loaded lazily, so consumers such as the
trainer never import the engine.
"""

__version__ = "0.1.0"
__all__ = ["Tap", "load_records", "Record"]


def __getattr__(name: str):
    if name == "Tap":
        from layertap.tap import Tap

        return Tap
    if name == "load_records":
        from layertap.transport.file import load_records

        return load_records
    if name == "Record":
        from layertap.records import Record

        return Record
    raise AttributeError(f"module 'layertap' has no attribute {name!r}")
