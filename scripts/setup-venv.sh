#!/usr/bin/env bash
# Create .venv and install nbdist with its dev extras, torch pinned to the local CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -c constraints-dev.txt -e ".[dev]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, nbdist; print('torch', torch.__version__, '| nbdist', nbdist.__version__)"
