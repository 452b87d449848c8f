#!/usr/bin/env bash
# Install what the tests need, then run the whole CPU test suite (unit + functional).
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/install.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# tests/gpu holds the CUDA-only tests: collected here so that they report as skipped without a GPU
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider --durations=25 tests/unit tests/functional tests/gpu "$@"
