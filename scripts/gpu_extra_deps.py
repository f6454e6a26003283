"""Install, from a folder of carried wheels, what these imports miss on the bare GPU machine (no network):

    python3 scripts/gpu_extra_deps.py WHEEL_DIR module.a module.b ...

Imports each module in a fresh interpreter; on ``No module named 'x'`` installs the wheel for ``x``
(``pip install --no-deps``) and tries again, until the imports work or a missing module has no wheel
there (exit 1, naming it). Used by ``scripts/gpu_check.sh serve`` for vLLM's API server and its load
generator, whose dependencies the lean vLLM bundle leaves out.

A module written ``pkg.*`` is walked: every submodule of ``pkg`` is imported too (the API server imports
some of its routes only when it builds the app, after the model has loaded: vLLM 0.25.1's metrics route
needs ``prometheus_fastapi_instrumentator`` there). A walked submodule's missing dependency is installed
when its wheel is carried and only reported when it is not (optional features: tool parsers, ...)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# import name -> distribution name where they differ
DIST = {"PIL": "pillow", "multipart": "python_multipart", "python_multipart": "python_multipart", "yaml": "pyyaml",
        "dotenv": "python_dotenv", "jwt": "pyjwt", "dns": "dnspython", "pythonjsonlogger": "python_json_logger",
        "cpuinfo": "py_cpuinfo", "attr": "attrs", "rpds": "rpds_py", "google": "protobuf",
        "opentelemetry": "opentelemetry_api", "importlib_metadata": "importlib_metadata", "jinja2": "jinja2",
        "markupsafe": "markupsafe", "charset_normalizer": "charset_normalizer", "typing_extensions": "typing_extensions"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def main(argv: list[str]) -> int:
    import os

    target = os.path.expanduser("~/vllm-site")  # where the vLLM bundle went (install-on-device.sh), on PYTHONPATH
    wheels = {norm(p.name.split("-")[0]): p for p in Path(argv[0]).glob("*.whl")}
    mods = [m for m in argv[1:] if not m.endswith(".*")]
    walked = [m[:-2] for m in argv[1:] if m.endswith(".*")]
    installed: list[str] = []
    rc = _direct(mods, wheels, target, installed)
    if rc == 0 and walked:
        rc = _walk(walked, wheels, target, installed)
    return rc


WALK = """
import importlib, pkgutil, sys
for root in sys.argv[1:]:
    pkg = importlib.import_module(root)
    for info in pkgutil.walk_packages(pkg.__path__, root + "."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if e.name and e.name.split(".")[0] != root.split(".")[0]:
                print("MISSING", e.name.split(".")[0], info.name, flush=True)
        except Exception:
            pass  # not a missing package (platform checks, optional hardware): not ours to fix
"""


WALK_TIMEOUT_S = 240


def _walk(roots: list[str], wheels: dict[str, Path], target: str, installed: list[str]) -> int:
    """Import every submodule of ``roots``; install carried wheels for what they miss; report the rest."""
    for _ in range(60):
        try:
            r = subprocess.run([sys.executable, "-c", WALK, *roots], capture_output=True, text=True, timeout=WALK_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # the walk is a best effort beside the direct imports, which passed
            print(f"walking {', '.join(roots)} took over {WALK_TIMEOUT_S} s; stopped (installed so far: "
                  f"{', '.join(installed) or 'nothing'})")
            return 0
        missing: dict[str, str] = {}
        for line in r.stdout.splitlines():
            if line.startswith("MISSING "):
                _, name, where = line.split(" ", 2)
                missing.setdefault(name, where)
        todo = [(n, wheels.get(norm(DIST.get(n, n)))) for n in missing]
        todo = [(n, w) for n, w in todo if w is not None and w.name not in installed]
        if not todo:
            if r.returncode != 0:
                print(r.stderr[-3000:])
                return 1
            print(f"walked {', '.join(roots)}: installed {', '.join(installed) or 'nothing'}; without a carried wheel "
                  f"(optional here): " + (", ".join(f"{n} ({w})" for n, w in sorted(missing.items())) or "none"))
            return 0
        for _, whl in todo:
            _install(whl, [], target)
            installed.append(whl.name)
    return 1


def _install(whl: Path, extra: list[Path], target: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", target, "--upgrade", str(whl), *map(str, extra)], check=True)


def _direct(mods: list[str], wheels: dict[str, Path], target: str, installed: list[str]) -> int:
    for _ in range(60):
        r = subprocess.run([sys.executable, "-c", "; ".join(f"import {m}" for m in mods)], capture_output=True, text=True)
        if r.returncode == 0:
            print(f"imports ok ({', '.join(mods)}); installed: {', '.join(installed) or 'nothing'}")
            return 0
        m = re.search(r"No module named '([^'.]+)", r.stderr)
        if not m:
            print(r.stderr[-3000:])
            return 1
        name = m.group(1)
        whl = wheels.get(norm(DIST.get(name, name)))
        extra = [p for k, p in wheels.items() if k.startswith("opentelemetry")] if name == "opentelemetry" else []
        if whl is None or whl.name in installed:
            print(f"missing module {name!r} and no carried wheel for it; installed so far: {installed}\n{r.stderr[-1500:]}")
            return 1
        _install(whl, extra, target)
        installed.append(whl.name)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
