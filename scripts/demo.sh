#!/usr/bin/env bash
# The main job: a headless demo (a group of 2 ranks, an all_reduce), then JupyterLab on the
# tutorials when --lab is given.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
.venv/bin/python -m nbdist doctor
.venv/bin/python -m nbdist demo --world-size 2
if [ "${1:-}" = "--lab" ]; then
  .venv/bin/python -m pip install -q -c constraints-dev.txt jupyterlab
  exec .venv/bin/python -m jupyter lab notebooks/
fi
