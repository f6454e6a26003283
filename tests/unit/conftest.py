import os
import signal
from pathlib import Path

import pytest


@pytest.fixture
def stop_detached(tmp_path: Path):
    """For tests of scripts/gpu_bg.sh and gpu_loop_bg.sh: their driver runs in a process session of its own,
    outside pytest's children; stop it after the test, passed or failed, so nothing is left running."""
    yield
    pid_file = tmp_path / "bg" / "pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
