"""Sphinx configuration for the nbdist site (Sphinx + myst-nb + furo), buildable offline.

    bash scripts/build-docs.sh            # -> docs/_build/html
    sphinx-build -W -b html docs docs/_build/html

Tutorials: ``docs/tutorials`` is a symlink to ``notebooks/``, so every ``notebooks/*.ipynb`` is a page
(``tutorials.md`` globs them). The notebooks are stored without outputs; myst-nb executes each one once
per build (``nb_execution_mode = "force"``) in a temporary directory, so the site shows them executed.
A cell that fails stops the build, except cells tagged ``raises-exception``. ``NBDIST_DOCS_EXECUTE``
overrides the mode (``cache`` re-executes only changed notebooks, ``off`` renders them unexecuted).
CI's docs test (tests/docs/test_docs.py) builds the same site in a temporary directory with ``off``,
from the tutorials as the test session executed them (nbclient, as myst-nb uses): each runs once.

Widgets: the executed notebooks keep their widget state; the page loads RequireJS and
``@jupyter-widgets/html-manager`` from ``_static/widgets/`` (fetched once with ``npm pack`` into
``docs/_build/.widgets-js``) instead of a CDN, so widgets render on an offline copy of the site. Without
npm the pages fall back to the CDN (``NBDIST_DOCS_WIDGETS=cdn`` asks for that directly).

``intersphinx_mapping`` stays empty: the build must not need the network (an unreachable inventory is
a warning, and warnings are errors here).
"""
from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # autodoc imports this checkout's nbdist even when not installed

import nbdist  # noqa: E402

# -- Project ----------------------------------------------------------------------------------------
project = "nbdist"
author = "nbdist developers"
copyright = "nbdist developers, BSD-3-Clause"
release = version = nbdist.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]
exclude_patterns = ["_build", "**/.ipynb_checkpoints", ".DS_Store", "Thumbs.db", "README.md"]
root_doc = "index"
intersphinx_mapping: dict = {}  # offline build: never fetch inventories

# -- MyST / myst-nb ---------------------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

nb_execution_mode = os.environ.get("NBDIST_DOCS_EXECUTE", "force")
nb_execution_timeout = int(os.environ.get("NBDIST_DOCS_CELL_TIMEOUT", "180"))  # seconds per cell
nb_execution_in_temp = True          # notebooks may write files: not into the source tree
nb_execution_raise_on_error = True   # a failing tutorial fails the build (raises-exception cells excepted)
nb_execution_show_tb = True
nb_execution_cache_path = str(HERE / "_build" / ".jupyter_cache")  # only for NBDIST_DOCS_EXECUTE=cache
# tutorial 12 needs a SLURM cluster and a kernel restart: shown unexecuted here; CI runs it against a
# local SLURM (tests/notebooks/test_tutorial_slurm.py)
nb_execution_excludepatterns = ["tutorials/12_*"]
nb_merge_streams = True              # ranks print line by line: one block per cell, not dozens

# -- Autodoc ----------------------------------------------------------------------------------------
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autosummary_generate = False         # summary tables only: nothing is written into the source tree
napoleon_google_docstring = True
napoleon_numpy_docstring = False


def _importable(modname: str) -> bool:
    try:
        importlib.import_module(modname)
    except Exception:  # an optional module that is absent, or needs an optional extra
        return False
    return True


_OPTIONAL = re.compile(r"<!-- optional: ([\w.]+) -->\n(.*?)<!-- end optional -->\n?", re.S)


def _drop_missing_modules(app, docname, source):
    """``api.md`` marks the sections of optional modules; leave out those that cannot be imported."""
    if docname == "api":
        source[0] = _OPTIONAL.sub(lambda m: m.group(2) if _importable(m.group(1)) else "", source[0])


# -- HTML -------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"nbdist {release}"
html_static_path = ["_static"]
html_css_files = ["nbdist.css"]
html_theme_options = {"navigation_with_keys": True}

# Widget JavaScript served from the site itself (see the module docstring).
HTML_MANAGER = "@jupyter-widgets/html-manager@1.0.15"  # ipywidgets 8.x
REQUIREJS = "requirejs@2.3.8"
WIDGETS_CACHE = Path(os.environ.get("NBDIST_DOCS_WIDGETS_CACHE", HERE / "_build" / ".widgets-js"))
_FONT = re.compile(r"\.(woff2?|ttf)$")
# The bundled widget modules compute their font URLs from their RequireJS module ids, relative to
# RequireJS's baseUrl: so baseUrl is pinned to _static/widgets/ and the icon fonts are put where the
# module ids point (two places). Without this the icons of buttons are missing.
_FONT_DIRS = ("@jupyter-widgets", "@jupyter-widgets/html-manager/dist")
_REQUIRE_CONFIG = """// nbdist docs: resolve RequireJS module ids (and so the widget icon fonts) under _static/widgets/
(function () {
  var src = document.currentScript.src;
  require.config({baseUrl: src.slice(0, src.lastIndexOf("/") + 1)});
})();
"""


def _fetch_widget_js(cache: Path) -> bool:
    """Put require.js, embed-amd.js and its fonts into ``cache/widgets`` (once); True if there."""
    target = cache / "widgets"
    stamp = target / "versions.json"
    want = {"html-manager": HTML_MANAGER, "requirejs": REQUIREJS, "layout": 2}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return True
    npm = shutil.which("npm")
    if npm is None:
        return False
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        try:
            subprocess.run([npm, "pack", "--silent", "--fetch-timeout=30000", "--fetch-retries=1",
                            HTML_MANAGER, REQUIREJS], cwd=tmp, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=90)
        except (OSError, subprocess.SubprocessError):
            return False
        staged = Path(tmp) / "widgets"
        for sub in _FONT_DIRS:
            (staged / sub).mkdir(parents=True)
        for tgz in Path(tmp).glob("*.tgz"):
            with tarfile.open(tgz) as tar:
                for member in tar.getmembers():
                    name = member.name
                    if not member.isfile():
                        continue
                    if name in ("package/require.js", "package/dist/embed-amd.js"):
                        (staged / Path(name).name).write_bytes(tar.extractfile(member).read())
                    elif name.startswith("package/dist/") and _FONT.search(name):
                        data = tar.extractfile(member).read()
                        for sub in _FONT_DIRS:
                            (staged / sub / Path(name).name).write_bytes(data)
        if not ((staged / "require.js").is_file() and (staged / "embed-amd.js").is_file()):
            return False
        (staged / "require-config.js").write_text(_REQUIRE_CONFIG)
        (staged / "versions.json").write_text(json.dumps(want))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staged, target)  # atomic: a concurrent build sees all files or none
    return True


if os.environ.get("NBDIST_DOCS_WIDGETS", "local") != "cdn" and _fetch_widget_js(WIDGETS_CACHE):
    html_static_path.append(str(WIDGETS_CACHE))  # its "widgets/" folder becomes _static/widgets/
    nb_ipywidgets_js = {
        "widgets/require.js": {},
        "widgets/require-config.js": {},
        # third-party widget modules (none in the tutorials) would still come from a CDN
        "widgets/embed-amd.js": {"data-jupyter-widgets-cdn": "https://cdn.jsdelivr.net/npm/"},
    }
    widgets_js = "local"
else:
    widgets_js = "cdn"  # myst-nb's default URLs


def setup(app):
    app.connect("source-read", _drop_missing_modules)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
