#!/usr/bin/env bash
# Run every test (creates the venv first if needed): in two pytest processes side by side
# (scripts/test_streams.py says how the tests are split). With arguments: one pytest, given them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
BIN=.venv/bin; [ -d .venv/Scripts ] && BIN=.venv/Scripts  # Windows' venv layout (CI matrix only)
"$BIN/lint-imports" --no-cache   # the layers contract in pyproject.toml
if [ "$#" -eq 0 ]; then
  exec "$BIN/python" scripts/test_streams.py
fi
exec "$BIN/python" -m pytest -q "$@"
