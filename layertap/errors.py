"""Errors a capture raises to its caller (``Tap.capture``, ``Tap.generate``, the pipeline's manager).

No imports: the CLI, the pipeline and ``layertap.analysis`` name these without importing the Tap (or
vLLM). ``layertap.tap`` re-exports them, so ``from layertap.tap import CaptureError`` works as before.
"""


class CaptureError(RuntimeError):
    """A capture request failed; the message names the input index / request."""


class RequestTooLong(CaptureError):
    """prompt + max_tokens + the capture's dummy draft token would pass max_model_len."""


class MissingRecords(CaptureError):
    """Requests finished but their records never arrived."""


class LayerZeroMismatch(CaptureError):
    """Layer id 0 does not equal the embedding of the tokens (a known vLLM bug in some modes)."""
