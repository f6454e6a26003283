#!/usr/bin/env bash
# Wheels that vLLM's API server and load generator (`vllm serve`, `vllm bench serve`) import and the lean
# GPU bundle (../shared/gpu/build-vllm-bundle.sh) leaves out, for the bare, offline GPU machine (Python 3.12).
# `scripts/gpu_check.sh serve` installs from DEST only what an import there misses (scripts/gpu_extra_deps.py).
# Usage: bash scripts/build-serve-wheels.sh [DEST]     (default .gpubundle/serve; ~45 MB; needs PyPI)
set -euo pipefail
dest=${1:-.gpubundle/serve}
mkdir -p "$dest"
plats=""; for n in 17 24 27 28 31 34 35 39; do plats="$plats --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plats \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 anthropic==2.15.0 anyio==4.16.0 astor==0.8.1 \
  attrs==26.1.0 certifi==2026.10.19.post1 charset_normalizer==3.5.3 click==8.5.1 cloudpickle==3.1.3 \
  deprecated==3.0.1 depyf==0.20.0 dill==0.4.1 diskcache==5.6.3 dnspython==2.9.2 docstring_parser==0.18.0 \
  einops==0.8.2 email_validator==2.4.0 filelock==4.3.1 frozenlist==1.8.0 h11==0.16.0 httpcore==1.0.9 \
  httptools==0.9.0 httpx==0.28.1 httpx2==2.16.2 httpx_sse==0.4.3 idna==3.20 ijson==3.6.0 \
  importlib_metadata==10.2.0 interegular==0.3.3 jinja2==3.1.6 jmespath==1.1.0 jsonschema==4.26.0 \
  jsonschema_specifications==2025.9.1 lark==1.2.2 lazy_importer==0.1.0 lm_format_enforcer==0.11.3 \
  markupsafe==3.0.4 mcp==2.3.0 mcp_types==2.3.0 mistral_common==1.13.1 \
  model_hosting_container_standards==0.1.16 multidict==7.2.1 opentelemetry_api==1.45.2 \
  opentelemetry_sdk==1.45.2 opentelemetry_semantic_conventions==0.66b2 \
  opentelemetry_semantic_conventions_ai==0.5.1 outlines_core==0.2.14 pillow==13.0.0 \
  prometheus_client==0.26.0 prometheus_fastapi_instrumentator==8.1.0 propcache==0.5.4 protobuf==7.36.2 \
  psutil==7.2.2 py_cpuinfo==9.0.0 pycountry==26.2.16 pydantic_extra_types==2.11.1 pydantic_settings==2.16.3 \
  pyjwt==2.15.1 python_dotenv==1.2.4 python_json_logger==4.2.0 python_multipart==0.0.34 pyyaml==6.0.4 \
  referencing==0.37.0 regex==2026.11.19 requests==2.34.2 rpds_py==2026.9.1 sentencepiece==0.2.3 \
  sse_starlette==3.7.0 supervisor==4.3.0 tiktoken==0.14.0 tqdm==4.70.1 typing_extensions==4.16.0 \
  urllib3==2.8.0 uvicorn==0.54.0 uvloop==0.23.0 watchfiles==1.3.0 websockets==17.4 wrapt==2.5.2 yarl==1.25.1 \
  zipp==4.1.2
du -sh "$dest"
