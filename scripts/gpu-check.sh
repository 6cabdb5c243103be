#!/usr/bin/env bash
# The GPU check: nccl and CUDA paths on a lent GPU machine, in one command (at most 8 minutes).
# It sets up the venv if needed, prints the machine (nvidia-smi, torch, NCCL), runs tests/gpu
# (skipped on a machine without CUDA) and ends with the figures the tests measured: the lines
# "GPU-CHECK what: figures". Extra arguments go to pytest.
# Usage: bash scripts/gpu-check.sh [-k bench]
set -uo pipefail
cd "$(dirname "$0")/.."
# seconds for the tests; with the 20 s grace after it, the start-up and the summary, the whole
# check stays under 8 minutes
LIMIT=${GPU_CHECK_LIMIT:-430}
NEEDS="import torch, cloudpickle, pytest, pytest_timeout, psutil, tqdm"
CUDA="import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
# The interpreter: $PYTHON, else .venv's where its torch sees CUDA, else a python3 that has torch
# with CUDA (a lent GPU machine has one and no network: nbdist runs from this tree, DeepSpeed's
# test skips where it is not installed), else .venv's (made if missing: needs the registries).
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "$CUDA" 2>/dev/null; then PY=.venv/bin/python
elif python3 -c "$NEEDS; $CUDA" 2>/dev/null; then PY=python3
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else
  if python3 -c "$CUDA" 2>/dev/null; then  # a CUDA torch, but not all the check needs: say what
    python3 -c "import importlib.util as u; print('gpu-check: python3 has torch with CUDA but not',
      ', '.join(m for m in '${NEEDS#import }'.split(', ') if u.find_spec(m) is None),
      '(pip install them, or set PYTHON=); making .venv instead')" >&2
  fi
  bash scripts/setup-venv.sh >/dev/null \
    || { echo "gpu-check: setting up .venv failed" >&2; exit 2; }
  PY=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && \
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader
"$PY" - <<'PYEOF'
import sys
import torch
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, cuda {torch.version.cuda}, available {cuda}, "
      f"gpus {torch.cuda.device_count() if cuda else 0}, "
      f"nccl {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else 'n/a'}")
if not cuda:  # every test would skip, and a check that checked nothing must not pass
    sys.exit(f"gpu-check: this torch ({torch.__version__}) sees no CUDA device: nothing to check "
             "(set PYTHON= to an interpreter whose torch has CUDA)")
PYEOF
[ $? -eq 0 ] || exit 3
log=$(mktemp)
timeout --signal=INT --kill-after=20 "$LIMIT" "$PY" -m pytest -s -q -rsx tests/gpu \
  --timeout=240 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
echo "---- what the GPU check measured ----"
grep "^GPU-CHECK" "$log" || echo "(nothing measured: see above)"
rm -f "$log"
exit "$rc"
