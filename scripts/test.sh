#!/usr/bin/env bash
# Run every test (creates the venv first if needed): with no arguments, in two pytest processes
# side by side (scripts/test_streams.py; 15-18 min instead of 23-24 on 2 cores), which is
# what CI runs; NBDIST_TEST_STREAMS=0 for one pytest. Arguments: one pytest with them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-venv.sh
# Bytecode caches written and shared: with PYTHONDONTWRITEBYTECODE set (container images often set
# it) every kernel, spawned rank and torchrun worker the suite starts compiles nbdist's modules
# again (about 0.35 CPU s each here; under Wine, torch's too: see scripts/windows-stack.sh).
unset PYTHONDONTWRITEBYTECODE
BIN=.venv/bin; [ -d .venv/Scripts ] && BIN=.venv/Scripts  # Windows' venv layout (CI matrix only)
"$BIN/lint-imports" --no-cache   # the layers contract in pyproject.toml
if [ "$#" -eq 0 ] && [ "${NBDIST_TEST_STREAMS:-1}" != "0" ]; then
  exec "$BIN/python" scripts/test_streams.py   # see docs/benchmarks.md, "the test suite"
fi
exec "$BIN/python" -m pytest -q "$@"
