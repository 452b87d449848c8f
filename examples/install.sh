#!/usr/bin/env bash
# Install the framework and what it needs into the current Python environment.
# PyTorch: an existing install (2.11-2.14) is kept; otherwise torch 2.13.0 is installed (a CPU build where
# pip finds one locally, e.g. on our CI machines), falling back to the default wheel for this platform.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.11,<2.15"
fi
"$PY" -m pip install -q -e ".[test]"
