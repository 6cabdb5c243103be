#!/usr/bin/env bash
# The Windows suite (issue 26): build the Windows stack under Wine (scripts/windows-stack.sh), then
# run, with the Windows python.exe, the unit tests and the Windows smoke set (tests/windows: every
# feature starts a group at least once). Tests that cannot run on Windows skip, naming the reason.
# Linux x86-64 as root (apt installs Wine); about 10 minutes on 2 cores. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${WINE_ROOT:-$PWD/.wine-ci}
PIP="${PIP:-$PWD/.venv/bin/python -m pip}"
[ -x .venv/bin/python ] || PIP="python3 -m pip"
PIP="$PIP" bash scripts/windows-stack.sh "$ROOT"
# shellcheck disable=SC1091
source "$ROOT/env.sh"
cd "$ROOT/src"
wpy -m pytest -q -p no:cacheprovider -rs --timeout=300 tests/unit tests/windows "$@"
