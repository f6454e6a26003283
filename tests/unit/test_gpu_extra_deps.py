"""scripts/gpu_extra_deps.py, as the GPU machine runs it before the serving benchmark: a missing import
gets its carried wheel installed (into ~/vllm-site), a walked package's submodules are imported too (vLLM's
API server imports some routes only when it builds the app), and what has no wheel is named."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_extra_deps.py"


def _wheel(where: Path, name: str) -> Path:
    """A minimal pure-Python wheel of package ``name`` (version 0.1)."""
    whl = where / f"{name}-0.1-py3-none-any.whl"
    info = f"{name}-0.1.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 1\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return whl


def _run(tmp: Path, *mods: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(tmp / "home"),
           "PYTHONPATH": os.pathsep.join([str(tmp / "pkgs"), str(tmp / "home" / "vllm-site")])}
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp / "wheels"), *mods], env=env,
                          capture_output=True, text=True, timeout=300)


def test_walk_installs_what_a_submodule_misses_and_names_the_rest(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels", "lt_carried_dep")
    pkg = tmp_path / "pkgs" / "lt_fakepkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "routes.py").write_text("import lt_carried_dep\n")  # imported only by a walk
    (pkg / "optional.py").write_text("import lt_not_carried_dep\n")
    (pkg / "platform.py").write_text("raise RuntimeError('not this hardware')\n")
    p = _run(tmp_path, "lt_fakepkg")
    assert p.returncode == 0 and "installed: nothing" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "home" / "vllm-site" / "lt_carried_dep").exists()
    p = _run(tmp_path, "lt_fakepkg", "lt_fakepkg.*")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "installed lt_carried_dep-0.1-py3-none-any.whl" in p.stdout
    assert "lt_not_carried_dep (lt_fakepkg.optional)" in p.stdout
    assert (tmp_path / "home" / "vllm-site" / "lt_carried_dep" / "__init__.py").exists()


def test_a_direct_import_without_a_wheel_fails_by_name(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "pkgs").mkdir()
    (tmp_path / "pkgs" / "lt_direct.py").write_text("import lt_not_carried_dep\n")
    p = _run(tmp_path, "lt_direct")
    assert p.returncode == 1 and "missing module 'lt_not_carried_dep'" in p.stdout, p.stdout + p.stderr
