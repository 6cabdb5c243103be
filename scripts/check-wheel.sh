#!/usr/bin/env bash
# Release check: build the sdist and the wheel, install the WHEEL (not editable) into a clean venv
# outside the repository, and use it the way a user would:
#
#   1. `python -m build` makes the sdist, then the wheel *from the sdist* (so both are complete or
#      this fails); the wheel must hold every file `git ls-files nbdist` lists, only nbdist, and the
#      version written in nbdist/__init__.py, which CHANGELOG.md has a section for;
#   2. a fresh `python -m venv` (no system site-packages) gets torch from constraints-dev.txt, the
#      wheel with its `notebook` extra, nbclient and ipykernel;
#   3. from a directory outside the repository (the source tree cannot be imported by accident):
#      `python -m nbdist doctor`, `python -m nbdist demo -n 2`, the `nbdist` console script, every
#      module in the wheel imported (only optional extras such as Lightning may be missing), the old
#      module paths (nbdist.worker, nbdist.shm, ...), `python -m nbdist.worker --help`;
#   4. notebooks/01_quickstart.ipynb executed with nbclient in that venv's kernel; an error fails.
#
#   bash scripts/check-wheel.sh           # ~1-2 min on 2 cores; .ci/run calls it after the tests
#   KEEP=1 bash scripts/check-wheel.sh    # keep the temp directory (dist/, venv/, logs) to look at
#   DIST_DIR=dist bash scripts/check-wheel.sh   # and copy the checked sdist and wheel there (releases)
#   PYTHON=python3.12 bash scripts/check-wheel.sh   # the interpreter for the fresh venv
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || bash scripts/setup-venv.sh

WORK=$(mktemp -d "${TMPDIR:-/tmp}/nbdist-wheel.XXXXXX")
cleanup() {
  local rc=$?
  if [ "${KEEP:-}" = 1 ] || [ $rc -ne 0 ]; then echo "check-wheel: files kept in $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
step() { printf '== %s  [%ds]\n' "$1" "$SECONDS"; }
# Run a command with a deadline (a hang fails CI instead of stalling it); show its log on failure.
run() {
  local secs=$1 log=$2; shift 2
  if ! timeout --kill-after=10 "$secs" "$@" >"$log" 2>&1; then
    echo "check-wheel: FAILED (or ran past ${secs} s): $*" >&2
    tail -n 60 "$log" >&2
    exit 1
  fi
}

# -- 1. build ----------------------------------------------------------------------------------------
step "build sdist and wheel"
.venv/bin/python -c "import build" 2>/dev/null \
  || .venv/bin/python -m pip install -q -c constraints-dev.txt build
# Built from a copy of the files git tracks (as they are in the working tree), never from the tree
# itself: a stale nbdist.egg-info/SOURCES.txt or build/ there would put files into the sdist that a
# fresh clone does not give setuptools, and hide exactly the mistakes this check is for.
mkdir -p "$WORK/src"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  git ls-files -z | while IFS= read -r -d '' f; do
    if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
  done | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
else  # not a git checkout (an unpacked sdist): the tree without build products
  tar --exclude=./.venv --exclude='*.egg-info' --exclude=./build --exclude=./dist \
      --exclude=./docs/_build --exclude=__pycache__ -cf - . | tar -xf - -C "$WORK/src"
fi
run 300 "$WORK/build.log" .venv/bin/python -m build --outdir "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/nbdist-*.whl)
SDIST=$(ls "$WORK"/dist/nbdist-*.tar.gz)
echo "   $(basename "$SDIST"), $(basename "$WHEEL")"

step "wheel contents against git ls-files nbdist"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
  untracked=$(git ls-files --others --exclude-standard nbdist)
  [ -z "$untracked" ] || echo "   note: not tracked by git, so left out (git add them?): $(echo $untracked)"
fi
(cd "$WORK/src" && find nbdist \( -type f -o -type l \) ! -name '*.pyc' ! -path '*/__pycache__/*' -print0) \
  >"$WORK/tracked"
.venv/bin/python - "$WHEEL" "$SDIST" "$WORK/tracked" <<'EOF'
import re, sys, tarfile, zipfile
from pathlib import Path

wheel, sdist, tracked = sys.argv[1:]
expected = {p for p in Path(tracked).read_text().split("\0") if p}
version = re.search(r'^__version__ = "([^"]+)"', (Path(tracked).parent / "src/nbdist/__init__.py").read_text(), re.M).group(1)
names = zipfile.ZipFile(wheel).namelist()
shipped = {n for n in names if not n.startswith(f"nbdist-{version}.dist-info/")}
problems = []
if missing := sorted(expected - shipped):
    problems.append(f"in git but not in the wheel: {missing}")
if stray := sorted(n for n in shipped if not n.startswith("nbdist/")):
    problems.append(f"the wheel ships more than nbdist/: {stray}")
if junk := sorted(n for n in shipped if "__pycache__" in n or n.endswith(".pyc")):
    problems.append(f"compiled files in the wheel: {junk}")
if not Path(wheel).name.startswith(f"nbdist-{version}-"):
    problems.append(f"wheel {Path(wheel).name} is not version {version} (nbdist/__init__.py)")
meta = zipfile.ZipFile(wheel).read(f"nbdist-{version}.dist-info/METADATA").decode()
if f"\nVersion: {version}\n" not in meta:
    problems.append(f"METADATA does not say Version: {version}")
entry = zipfile.ZipFile(wheel).read(f"nbdist-{version}.dist-info/entry_points.txt").decode()
if "nbdist = nbdist.__main__:main" not in entry:
    problems.append("no `nbdist` console script in entry_points.txt")
with tarfile.open(sdist) as tar:
    in_sdist = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
if missing := sorted(expected - in_sdist):
    problems.append(f"in git but not in the sdist: {missing}")
for needed in ("pyproject.toml", "README.md", "LICENSE"):
    if needed not in in_sdist:
        problems.append(f"{needed} is not in the sdist")
changelog = Path(tracked).parent / "src/CHANGELOG.md"
if changelog.exists() and f"## [{version}]" not in changelog.read_text():
    problems.append(f"CHANGELOG.md has no '## [{version}]' section for the version being built")
if extra := sorted(shipped - expected):
    print(f"   note: in the wheel but not in the source: {extra}")
if problems:
    sys.exit("check-wheel: " + "\n  ".join(["package contents are wrong:"] + problems))
print(f"   {len(shipped)} files, version {version}: every tracked nbdist file is in the wheel and the sdist")
EOF

# -- 2. a clean venv with the wheel --------------------------------------------------------------------
step "fresh venv: torch (constraints-dev.txt), the wheel[notebook], nbclient, ipykernel"
run 120 "$WORK/venv.log" "$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
run 600 "$WORK/pip.log" "$V/python" -m pip install --no-compile -c "$ROOT/constraints-dev.txt" \
  "torch==$(sed -n 's/^torch==//p' "$ROOT/constraints-dev.txt")" "$WHEEL[notebook]" nbclient ipykernel

# -- 3. smoke tests from outside the repository --------------------------------------------------------
mkdir -p "$WORK/run" "$WORK/jupyter/data" "$WORK/jupyter/config" "$WORK/jupyter/runtime" "$WORK/ipython"
cd "$WORK/run"
unset PYTHONPATH PYTHONHOME PYTHONSTARTUP JUPYTER_PATH VIRTUAL_ENV
export PYTHONNOUSERSITE=1 PYTHONSAFEPATH=1 PATH="$V:$PATH" IPYTHONDIR="$WORK/ipython" \
  JUPYTER_DATA_DIR="$WORK/jupyter/data" JUPYTER_CONFIG_DIR="$WORK/jupyter/config" \
  JUPYTER_RUNTIME_DIR="$WORK/jupyter/runtime" NBDIST_EXPECT_PREFIX="$WORK/venv"

step "python -m nbdist doctor"
run 120 "$WORK/doctor.log" "$V/python" -m nbdist doctor
step "python -m nbdist demo -n 2"
run 180 "$WORK/demo.log" "$V/python" -m nbdist demo -n 2
step "nbdist --help (console script); python -m nbdist.worker --help (old path)"
run 60 "$WORK/cli.log" "$V/nbdist" --help
run 60 "$WORK/worker.log" "$V/python" -m nbdist.worker --help
run 60 "$WORK/worker2.log" "$V/python" -m nbdist.runtime.worker --help

step "import every module of the installed wheel, the subpackages and the old paths"
run 180 "$WORK/imports.log" "$V/python" - <<'EOF'
import importlib, os, pkgutil, sys
import nbdist, nbdist.bench, nbdist.memory, nbdist.strategies, nbdist.ui.magics, nbdist.ui.widgets
import nbdist.ui.plots, nbdist.backends.shm, nbdist.backends.store, nbdist.runtime, nbdist.wire

prefix = os.path.realpath(os.environ["NBDIST_EXPECT_PREFIX"])
assert os.path.realpath(nbdist.__file__).startswith(prefix), f"nbdist from {nbdist.__file__}, not the venv"
OPTIONAL = {"lightning", "pytorch_lightning", "lightning_fabric", "fairscale", "deepspeed", "pandas"}
skipped = []
for mod in pkgutil.walk_packages(nbdist.__path__, "nbdist."):
    if mod.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(mod.name)
    except ImportError as e:  # only an optional extra may be missing, never a part of nbdist
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
        skipped.append(f"{mod.name} (needs {e.name})")
for name in nbdist.__all__ + list(nbdist.SUBPACKAGES):
    getattr(nbdist, name)
for old, new in nbdist.MOVED.items():
    assert importlib.import_module(old) is importlib.import_module(new), old
print("imported from", os.path.dirname(nbdist.__file__), "| skipped:", ", ".join(skipped) or "none")
EOF
tail -n 1 "$WORK/imports.log" | sed 's/^/   /'

# -- 4. a tutorial in this venv's kernel -----------------------------------------------------------------
step "notebooks/01_quickstart.ipynb in the venv's kernel (nbclient)"
cp "$ROOT/notebooks/01_quickstart.ipynb" "$WORK/run/"
run 420 "$WORK/notebook.log" "$V/python" - "$WORK/run/01_quickstart.ipynb" <<'EOF'
import os, sys
import nbformat
from nbclient import NotebookClient

path = sys.argv[1]
nb = nbformat.read(path, as_version=4)
# a last cell says which Python and which nbdist the kernel used
nb.cells.append(nbformat.v4.new_code_cell("import sys, nbdist; print(sys.prefix); print(nbdist.__file__)"))
# cells tagged raises-exception may raise; any other error raises CellExecutionError here
NotebookClient(nb, timeout=180, kernel_name="python3",
               resources={"metadata": {"path": os.path.dirname(path)}}).execute()
text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
prefix = os.path.realpath(os.environ["NBDIST_EXPECT_PREFIX"])
last = nb.cells[-1].outputs[0]["text"].split()
assert os.path.realpath(last[0]) == prefix, f"the kernel ran in {last[0]}, not in {prefix}"
assert os.path.realpath(last[1]).startswith(prefix), f"the kernel imported {last[1]}"
for needle in ("tensor([3., 3., 3.])", "something went wrong on rank 1", "still here on rank 1"):
    assert needle in text, f"{needle!r} not in the notebook's outputs"
print(f"executed {len(nb.cells)} cells in {last[0]}")
EOF
tail -n 1 "$WORK/notebook.log" | sed 's/^/   /'

if [ -n "${DIST_DIR:-}" ]; then
  case $DIST_DIR in /*) dest=$DIST_DIR ;; *) dest=$ROOT/$DIST_DIR ;; esac  # relative: to the repo
  mkdir -p "$dest"
  cp "$SDIST" "$WHEEL" "$dest/"
  echo "   copied to $dest/: $(basename "$SDIST") $(basename "$WHEEL")"
fi
step "check-wheel: OK ($(basename "$WHEEL"))"
