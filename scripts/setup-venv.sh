#!/usr/bin/env bash
# Create .venv and install nbdist with its dev extras, torch pinned to the local CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || [ -x .venv/Scripts/python.exe ] || "$PY" -m venv .venv
BIN=.venv/bin; [ -d .venv/Scripts ] && BIN=.venv/Scripts  # Windows' venv layout (CI matrix only)
"$BIN/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# [dev] includes nbdist[ray] (Ray, pinned in constraints-dev.txt) for the Ray engine's tests
# .[dev] brings the on="k8s" test tools too: kubernetes, kubernetes-validate, kmock, pytest-asyncio
"$BIN/python" -m pip install -q -c constraints-dev.txt -e ".[dev]" 2>&1 | grep -v "is ignored" || true
"$BIN/python" -c "import torch, nbdist; print('torch', torch.__version__, '| nbdist', nbdist.__version__)"
