"""The CPU generator rewind behind seeded sampling with chunked prefill (the real engine path is in
tests/engine: test_analysis, test_capture_qwen3, test_serve)."""

import pytest
import torch

from layertap.engine.seed_rewind import RewindableCPUGenerator


def _draw(g: torch.Generator) -> torch.Tensor:
    return torch.empty(64).exponential_(generator=g)


def test_rewind_restores_the_state_of_the_step_start():
    plain = torch.Generator().manual_seed(3)
    g = RewindableCPUGenerator(torch.Generator().manual_seed(3))
    g.mark()
    _draw(g), _draw(g)  # a partial prefill's discarded draws (the extract path draws twice)
    g.set_offset(g.get_offset() - 4)  # what vLLM's runner calls after the discarded step
    assert torch.equal(_draw(g), _draw(plain))  # the kept step samples what an unchunked prompt samples
    g.mark()
    assert torch.equal(_draw(g), _draw(plain))  # later steps go on from there
    g.set_offset(0)
    g.mark()
    assert not torch.equal(_draw(g), _draw(torch.Generator().manual_seed(3)))


def test_rewind_without_a_mark_is_loud():
    g = RewindableCPUGenerator(torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="before any step marked it"):
        g.set_offset(0)
