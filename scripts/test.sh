#!/usr/bin/env bash
# Run every test (creates the venv first if needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
.venv/bin/lint-imports --no-cache   # the layers contract in pyproject.toml
exec .venv/bin/python -m pytest -q "$@"
