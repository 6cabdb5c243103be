#!/usr/bin/env bash
# Run every test (creates the venv first if needed), in one pytest; extra arguments go to it.
# NBDIST_TEST_STREAMS=1 (and no arguments): in two pytest processes side by side instead
# (scripts/test_streams.py), about 15-16 min instead of 23-24 on 2 cores; not CI's default yet.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
BIN=.venv/bin; [ -d .venv/Scripts ] && BIN=.venv/Scripts  # Windows' venv layout (CI matrix only)
"$BIN/lint-imports" --no-cache   # the layers contract in pyproject.toml
if [ "$#" -eq 0 ] && [ "${NBDIST_TEST_STREAMS:-0}" = "1" ]; then
  exec "$BIN/python" scripts/test_streams.py   # opt-in: see docs/benchmarks.md, "the test suite"
fi
exec "$BIN/python" -m pytest -q "$@"
