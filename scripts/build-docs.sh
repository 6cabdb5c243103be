#!/usr/bin/env bash
# Build the documentation site (Sphinx + myst-nb + furo), offline, warnings as errors.
#
#   bash scripts/build-docs.sh [OUTDIR]        # default docs/_build/html; open OUTDIR/index.html
#
# Every notebooks/*.ipynb is executed once, top to bottom, in a fresh kernel during the build
# (myst-nb, nb_execution_mode="force", cells tagged raises-exception may raise), so the tutorials
# appear executed on the site; a failing tutorial fails the build. About a minute on 2 cores.
#   NBDIST_DOCS_EXECUTE=cache  re-execute only notebooks whose code changed (docs/_build/.jupyter_cache)
#   NBDIST_DOCS_EXECUTE=off    don't execute (pages show the code without outputs)
#   NBDIST_DOCS_WIDGETS=cdn    load the widget JavaScript from a CDN instead of _static/widgets/
#                              (by default it is fetched once with npm into docs/_build/.widgets-js)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup-venv.sh
if ! .venv/bin/python -c "import sphinx, myst_nb, furo" 2>/dev/null; then
  .venv/bin/python -m pip install -q -c constraints-dev.txt -e ".[docs]"
fi
OUT=${1:-docs/_build/html}
start=$(date +%s)
.venv/bin/python -m sphinx -W --keep-going -b html docs "$OUT"
echo "docs built in $(( $(date +%s) - start )) s: $OUT/index.html"
