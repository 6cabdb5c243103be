#!/usr/bin/env bash
# The Windows suite (issue 26): build the Windows stack under Wine (scripts/windows-stack.sh), then
# run, with the Windows python.exe, the unit tests and the Windows smoke set (tests/windows: every
# feature starts a group at least once). Tests that cannot run on Windows skip, naming the reason.
# Linux x86-64 as root (apt installs Wine); about 5 minutes on 2 cores. With no arguments the two
# folders run side by side, in two pytest processes (scripts/test_streams.py --windows: one keeps
# about one core busy under Wine); NBDIST_TEST_STREAMS=0 for one pytest. Extra arguments: one
# pytest with them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${WINE_ROOT:-$PWD/.wine-ci}
PY="$PWD/.venv/bin/python"
[ -x "$PY" ] || PY=python3
PIP="${PIP:-$PY -m pip}"
PIP="$PIP" bash scripts/windows-stack.sh "$ROOT"
# shellcheck disable=SC1091
source "$ROOT/env.sh"
cd "$ROOT/src"
# The same options both ways (and in .github/workflows/ci.yml's Windows job: tests/docs checks it)
if [ "$#" -eq 0 ] && [ "${NBDIST_TEST_STREAMS:-1}" != "0" ]; then
  exec "$PY" "$REPO/scripts/test_streams.py" --windows "/usr/lib/wine/wine64 $ROOT/py/python.exe" \
    -p no:cacheprovider -rs --timeout=300
fi
wpy -m pytest -q -p no:cacheprovider -rs --timeout=300 tests/unit tests/windows "$@"
