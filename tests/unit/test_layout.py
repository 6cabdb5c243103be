"""The shape of the code: layers (import-linter), no import circles, small modules, documented parts."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nbdist"
MAX_LINES = 400
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py"}


def _graph():
    grimp = pytest.importorskip("grimp")
    return grimp.build_graph("nbdist", cache_dir=None)


def _cycles(graph):
    """Strongly connected components of more than one module (Tarjan), lazy imports included."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.find_modules_directly_imported_by(node):
            if not nxt.startswith("nbdist"):
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            comp = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                comp.append(top)
                if top == node:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for module in sorted(m for m in graph.modules if m.startswith("nbdist")):
        if module not in index:
            visit(module)
    return out


def test_no_import_circles_counting_imports_inside_functions():
    graph = _graph()
    # the scanner sees an import inside a function (a record's lazy .plot()):
    assert graph.direct_import_exists(importer="nbdist.bench.records",
                                      imported="nbdist.ui.plots.collectives")
    assert _cycles(graph) == []


def test_lint_imports_keeps_every_contract():
    exe = pathlib.Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (pip install nbdist[dev])")
    out = subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_modules_stay_under_400_lines():
    big = {}
    for path in list(PACKAGE.rglob("*.py")) + list((ROOT / "benchmarks").glob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            big[str(path.relative_to(ROOT))] = n
    assert big == {}


def test_top_level_is_only_the_front_door_the_cli_and_the_errors():
    modules = {p.name for p in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL


def test_every_package_says_what_it_owns_and_what_it_may_import():
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc, f"{init.relative_to(ROOT)} has no docstring"
    for part in ("wire", "backends", "runtime", "ui", "report"):
        source = (PACKAGE / part / "__init__.py").read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(source))
        assert "May import" in doc or "may import" in doc, part


def test_moved_modules_keep_their_documented_paths():
    code = ("import nbdist.shm, nbdist.store_backend, nbdist.worker, nbdist.group\n"
            "import nbdist.backends.shm, nbdist.backends.store, nbdist.runtime.worker\n"
            "assert nbdist.shm is nbdist.backends.shm\n"
            "assert nbdist.store_backend is nbdist.backends.store\n"
            "assert nbdist.worker is nbdist.runtime.worker\n"
            "assert nbdist.runtime.worker.__spec__.name == 'nbdist.runtime.worker'\n"
            "from nbdist.store_backend import create\n"
            "from nbdist.launcher import prewarm\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert out.stdout.strip() == "ok", out.stderr
    help_text = subprocess.run([sys.executable, "-m", "nbdist.worker", "--help"],
                               capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "--connect" in help_text.stdout, help_text.stderr
