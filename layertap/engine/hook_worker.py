"""The worker class vLLM loads (``worker_cls``): vLLM's own worker for this platform, with layertap's
additions installed right after the model is loaded (``compat.prepare_worker``: the hook capture path,
and on the CPU build the seeded-sampling fix). Importing it in an engine process under a Tap also
registers the watchdog's stack dumps there (``watchdog.register_stack_dumps``)."""

from __future__ import annotations

from typing import Any

from layertap.engine import compat, watchdog

watchdog.register_stack_dumps()

_Base: Any = compat.platform_worker_class()


class LayertapWorker(_Base):  # type: ignore[misc, valid-type]
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        compat.prepare_worker(self.model_runner, self.vllm_config)
