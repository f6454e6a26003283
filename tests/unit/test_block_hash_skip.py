"""compat.skip_request_block_hashes: a one-shot replacement of vLLM's ``get_request_block_hasher`` in the engine
core's module (the real vLLM module of the CPU build, no engine): armed only without prefix caching, used once
and then gone, and put back by name when the engine core never asked for it."""

from types import SimpleNamespace

import vllm.v1.engine.core as core

from layertap.engine import compat


def config(prefix_caching: bool):
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))


def test_armed_without_prefix_caching_used_once_then_the_original_is_back():
    original = core.get_request_block_hasher
    assert compat.skip_request_block_hashes(config(prefix_caching=True)) is False
    assert core.get_request_block_hasher is original
    assert compat.skip_request_block_hashes(config(prefix_caching=False)) is True
    assert core.get_request_block_hasher is not original
    assert core.get_request_block_hasher(16, lambda x: b"") is None  # what EngineCore.__init__ gets
    assert core.get_request_block_hasher is original  # the next engine in this process hashes as usual
    compat.check_block_hashes_skipped()  # used: nothing to undo
    assert core.get_request_block_hasher is original


def test_an_unused_one_shot_is_undone_at_the_first_step():
    original = core.get_request_block_hasher
    assert compat.skip_request_block_hashes(config(prefix_caching=False)) is True
    compat.check_block_hashes_skipped()  # the engine core never asked: put back, with a warning
    assert core.get_request_block_hasher is original
    assert callable(core.get_request_block_hasher(16, lambda x: b"x"))
