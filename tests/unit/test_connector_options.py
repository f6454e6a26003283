"""Connector switches as a caller gives them: the Tap's ``connector_options`` and ``layertap serve
--connector-options`` go through one check, so a typo is refused by name instead of being ignored by the
connector, and what is accepted reaches the engine's ``kv_transfer_config``."""

from __future__ import annotations

import argparse
import json

import pytest

from layertap.engine import launch
from layertap.pipeline import serve


def test_known_options_pass_and_unknown_ones_are_named():
    assert launch.check_connector_options(None) == {}
    assert launch.check_connector_options({"lean": False}) == {"lean": False}
    with pytest.raises(ValueError, match=r"unknown connector options \['leen'\]"):
        launch.check_connector_options({"leen": False})
    with pytest.raises(ValueError, match="must be a mapping"):
        launch.check_connector_options(["lean"])
    # skip_reads (no record read or written) only where nothing waits for records: layertap serve
    with pytest.raises(ValueError, match="skip_reads"):
        launch.check_connector_options({"skip_reads": True})


def test_serve_flag_refuses_bad_json_and_unknown_keys():
    assert serve.connector_options(None) == {}
    assert serve.connector_options('{"skip_reads": true}') == {"skip_reads": True}
    with pytest.raises(ValueError, match="--connector-options is not JSON"):
        serve.connector_options("{lean: false}")
    with pytest.raises(ValueError, match=r"unknown connector options \['fast'\]"):
        serve.connector_options('{"fast": 1}')


def test_serve_options_reach_the_engines_connector_config():
    args = argparse.Namespace(capture_all=True, capture_path="hook", host="127.0.0.1", port=8123,
                              engine_argv=["--max-model-len", "64"], connector_options={"lean": False})
    argv = serve.server_argv(args, {"backend": "shm", "name": "x"}, {"model": "/m"}, [1, 2])
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = cfg["kv_connector_extra_config"]
    assert extra["lean"] is False and extra["capture_all"] is True and extra["layer_ids"] == [1, 2], extra
    assert argv[-2:] == ["--max-model-len", "64"]


def test_the_serve_command_line_refuses_bad_options_before_anything_starts(capsys):
    """Parsed with the command line: `layertap serve` exits 2 naming the problem, before a model is read or a
    transport made (the model path here does not exist)."""
    from layertap.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent", "--layers", "1", "--connector-options", '{"leen": false}'])
    assert e.value.code == 2
    assert "unknown connector options ['leen']" in capsys.readouterr().err
