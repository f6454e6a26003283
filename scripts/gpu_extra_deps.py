"""Install, from a folder of carried wheels, what these imports miss on the bare GPU machine (no network):

    python3 scripts/gpu_extra_deps.py WHEEL_DIR module.a module.b ...

Imports each module in a fresh interpreter; on ``No module named 'x'`` installs the wheel for ``x``
(``pip install --no-deps``) and tries again, until the imports work or a missing module has no wheel
there (exit 1, naming it). Used by ``scripts/gpu_check.sh serve`` for vLLM's API server and its load
generator, whose dependencies the lean vLLM bundle leaves out."""

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
    mods = argv[1:]
    installed: list[str] = []
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
            print(f"missing module {name!r} and no wheel for it in {argv[0]}; installed so far: {installed}\n{r.stderr[-1500:]}")
            return 1
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                        "--target", target, "--upgrade", str(whl), *map(str, extra)], check=True)
        installed.append(whl.name)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
