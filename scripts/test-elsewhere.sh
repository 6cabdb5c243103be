#!/usr/bin/env bash
# Run pytest (ARGS) as on another machine, to catch tests that assume this one (issue 25).
# Linux, as root (private mount and UTS namespaces; nothing outside them changes):
#   /dev/shm      a private tmpfs of $SHM_SIZE (default 64m, Docker's default)
#   hostname      $HOST_NAME (default: a long one that does not resolve, as in many containers)
#   TMPDIR, HOME  fresh directories whose paths hold spaces
#   TZ, locale    Asia/Kathmandu (UTC+5:45), LC_ALL=C (Python coerces it to UTF-8)
#   CPUS          when set, the CPUs it may run on (taskset), e.g. CPUS=0 for one core
#   SIGINT        ignored, as for a job a shell without job control starts in the background
# Example: bash scripts/test-elsewhere.sh tests/integration/test_shm_backend.py
# Users: run as root, then as another user with `setpriv --reuid=65534 --regid=65534
# --clear-groups` (add `--inh-caps=+dac_read_search --ambient-caps=+dac_read_search` when the
# interpreter sits in a root-only directory); tests that need root skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "needs root (unshare --mount --uts)" >&2; exit 2; }
PYTHON=${PYTHON:-.venv/bin/python}  # or another interpreter with the dev extras
export SHM_SIZE=${SHM_SIZE:-64m} HOST_NAME=${HOST_NAME:-ci-runner-0042-a-rather-long-pod-name-x7k2q.example}
exec unshare --mount --uts --propagation private bash -c '
set -euo pipefail
mount -t tmpfs -o "size=$SHM_SIZE,mode=1777" tmpfs /dev/shm
hostname "$HOST_NAME"
base=$(mktemp -d "/tmp/nbdist elsewhere.XXXXXX")
trap "rm -rf \"$base\"" EXIT
export TMPDIR="$base/tmp dir" HOME="$base/home dir" TZ=Asia/Kathmandu LC_ALL=C LANG=C
mkdir -p "$TMPDIR" "$HOME"
chmod -R 1777 "$base"
run=("$0" -m pytest -q "$@")
if [ -n "${CPUS:-}" ]; then run=(taskset -c "$CPUS" "${run[@]}"); fi
trap "" INT
"${run[@]}"
' "$PYTHON" "$@"
