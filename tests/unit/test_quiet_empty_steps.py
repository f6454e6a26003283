"""Steps that run no forward skip vLLM's KV-connector round when layertap has nothing in them
(``compat.install_quiet_empty_steps``). Here: vLLM's own runner classes, patched, with layertap's connector
and worker-side objects built without an engine (``object.__new__``); a stand-in only where the real
object needs a running engine (the worker's record process). The skip itself is counted on the GPU (step
profile, benchmark variant ``capture-loud``); the CPU build runs synchronous scheduling, so its engines
make no such empty steps, and the engine suite runs with the patch installed."""

from types import SimpleNamespace as NS

import pytest

from layertap.engine import compat
from layertap.engine.connector import LayertapConnector
from layertap.engine.record_writer import WorkerSide
from layertap.engine.saves import LayertapMetadata, SaveJob, SlotCheck


class Reached(Exception):
    """vLLM's own round was entered (its first call into the connector)."""


def connector(quiet=True):
    c = object.__new__(LayertapConnector)
    c._quiet_empty = quiet
    w = object.__new__(WorkerSide)
    w.released, w.error, w.rp = set(), None, None
    c._worker = w

    def handle_preemptions(meta):  # the first thing vLLM's round does with the connector (both runners)
        raise Reached

    c.handle_preemptions = handle_preemptions
    c.bind_connector_metadata = handle_preemptions
    return c


def job():
    return SaveJob("r", "k", [1], [5, 6], 2, {})


@pytest.fixture(scope="module")
def patched():
    names = compat.install_quiet_empty_steps()
    assert "ActiveKVConnector.no_forward" in names and "KVConnectorModelRunnerMixin.kv_connector_no_forward" in names
    assert compat.install_quiet_empty_steps() == names  # once per process
    return names


_CONFIG = []


def vllm_config():
    """A default VllmConfig (no model): what vLLM's V1 round opens its forward context with."""
    if not _CONFIG:
        from vllm.config import VllmConfig

        _CONFIG.append(VllmConfig())
    return _CONFIG[0]


def v2_round(c, meta):
    from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

    a = object.__new__(ActiveKVConnector)
    a.kv_connector, a._disabled, a.vllm_config = c, False, None
    return a.no_forward(NS(kv_connector_metadata=meta, finished_req_ids=set()))


def v1_round(c, meta, monkeypatch):
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", c)
    return KVConnectorModelRunnerMixin.kv_connector_no_forward(NS(kv_connector_metadata=meta, finished_req_ids=set()),
                                                               vllm_config())


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_an_empty_step_with_nothing_for_layertap_skips_the_round(patched, runner, monkeypatch):
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    def run(c, meta):
        return v2_round(c, meta) if runner == "v2" else v1_round(c, meta, monkeypatch)

    before = dict(compat.QUIET_EMPTY_COUNTS)
    assert run(connector(), LayertapMetadata()) is EMPTY_MODEL_RUNNER_OUTPUT
    assert compat.QUIET_EMPTY_COUNTS["skipped"] == before["skipped"] + 1
    # a save or a slot check in the step, something to report, a failure, or the option off: vLLM's round
    with pytest.raises(Reached):
        run(connector(), LayertapMetadata(saves=[job()]))
    with pytest.raises(Reached):
        run(connector(), LayertapMetadata(checks=[SlotCheck("r", [1], 0, 2)]))
    c = connector()
    c._worker.released.add("r")
    with pytest.raises(Reached):
        run(c, LayertapMetadata())
    c = connector()
    c._worker.error = RuntimeError("writer failed")
    with pytest.raises(Reached):
        run(c, LayertapMetadata())
    c = connector()
    c._worker.rp = NS(failed=lambda: True)  # the record process reported an error: the round raises it
    with pytest.raises(Reached):
        run(c, LayertapMetadata())
    with pytest.raises(Reached):
        run(connector(quiet=False), LayertapMetadata())
    with pytest.raises(Reached):  # another connector's metadata
        run(connector(), object())
    assert compat.QUIET_EMPTY_COUNTS["through"] == before["through"] + 7


def test_another_connector_keeps_vllms_round(patched, monkeypatch):
    """A connector that is not layertap's (no ``quiet_empty_step``) always goes through vLLM's round."""
    class Other(LayertapConnector):  # a KVConnectorBase_V1 that has no quiet_empty_step
        quiet_empty_step = None

    other = object.__new__(Other)
    other.handle_preemptions = other.bind_connector_metadata = connector().handle_preemptions
    with pytest.raises(Reached):
        v2_round(other, LayertapMetadata())
    with pytest.raises(Reached):
        v1_round(other, LayertapMetadata(), monkeypatch)
