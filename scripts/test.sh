#!/usr/bin/env bash
# Run the test suite (unit + real vLLM CPU engine tests). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider -m "not gpu" --durations=15 "$@" tests
