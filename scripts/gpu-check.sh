#!/usr/bin/env bash
# The GPU check: nccl and CUDA paths on a lent GPU machine, in one command (at most 8 minutes).
# It sets up the venv if needed, prints the machine (nvidia-smi, torch, NCCL), runs tests/gpu
# (skipped on a machine without CUDA) and ends with the figures the tests measured: the lines
# "GPU-CHECK what: figures". Extra arguments go to pytest.
# Usage: bash scripts/gpu-check.sh [-k bench]
set -uo pipefail
cd "$(dirname "$0")/.."
LIMIT=${GPU_CHECK_LIMIT:-470}   # seconds for the tests: the whole check stays under 8 minutes
# The interpreter: $PYTHON, else .venv's, else a python3 that has torch (a lent GPU machine has one
# and no network: nbdist runs from this tree, DeepSpeed's test skips where it is not installed),
# else a new .venv (needs the package registries).
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
elif python3 -c "import torch, cloudpickle, pytest, pytest_timeout, psutil" 2>/dev/null; then PY=python3
else
  bash scripts/setup-venv.sh >/dev/null || { echo "gpu-check: setting up .venv failed" >&2; exit 2; }
  PY=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader
"$PY" - <<'PYEOF'
import torch
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, available {cuda}, "
      f"gpus {torch.cuda.device_count() if cuda else 0}, "
      f"nccl {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else 'n/a'}")
PYEOF
log=$(mktemp)
timeout --signal=INT --kill-after=20 "$LIMIT" "$PY" -m pytest -s -q tests/gpu \
  --timeout=240 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
echo "---- what the GPU check measured ----"
grep "^GPU-CHECK" "$log" || echo "(nothing measured: see above)"
rm -f "$log"
exit "$rc"
