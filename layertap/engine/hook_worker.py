"""The worker class vLLM loads (``worker_cls``) for hook capture: vLLM's own worker for this platform,
with the capture hook installed right after the model is loaded (``compat.install_capture_hook``)."""

from __future__ import annotations

from typing import Any

from layertap.engine import compat

_Base: Any = compat.platform_worker_class()


class LayertapWorker(_Base):  # type: ignore[misc, valid-type]
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        compat.install_capture_hook(self.model_runner, self.vllm_config)
