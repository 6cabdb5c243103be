#!/usr/bin/env bash
# Run every test (creates the venv first if needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
BIN=.venv/bin; [ -d .venv/Scripts ] && BIN=.venv/Scripts  # Windows' venv layout (CI matrix only)
"$BIN/lint-imports" --no-cache   # the layers contract in pyproject.toml
exec "$BIN/python" -m pytest -q "$@"
