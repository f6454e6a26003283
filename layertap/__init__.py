"""layertap: per-request hidden states from a live vLLM engine."""
__version__ = "0.1.0"
