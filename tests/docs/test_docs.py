"""The documentation site, the conda environment file and the Binder image definition.

The site is built once per module with ``sphinx-build -W`` (warnings are errors) into a temporary
directory, as ``scripts/build-docs.sh`` does, with one difference: ``scripts/build-docs.sh`` has
myst-nb execute every tutorial during the build, while here the build renders the tutorials as the
session executed them once (``tutorial_runs`` in tests/conftest.py: nbclient, as myst-nb uses), so
the suite does not run each tutorial twice; the tutorial pages must show outputs. About three
minutes on 2 cores when this module asks first (running the tutorials), ten seconds after.

Binder is checked with ``repo2docker --no-build``, which prints the Dockerfile without Docker.
``environment.yml`` can only be checked for structure: conda cannot solve environments here.
"""
from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BUILD_TIMEOUT = 540  # s; the build takes ~60 s on 2 idle cores

PAGES = ["index", "install", "platforms", "guide", "tutorials", "parallel", "pipelines", "multinode", "benchmarks",
         "troubleshooting", "api", "architecture"]


def _run_group(cmd, timeout, **kwargs):
    """Run ``cmd`` in its own process group; on timeout kill the whole group (kernels, ranks)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{cmd[:4]} ran past {timeout} s:\n{out[-6000:]}")
    return proc.returncode, out


def _stage(tmp, tutorial_runs):
    """A source tree for the build: docs/'s pages copied, ``tutorials/`` holding each tutorial as
    the session executed it (``tutorial_runs``). conf.py and ``_static`` are links: conf.py resolves
    its own path, so it still finds the checkout and the widget JavaScript cache. The pages are
    copies because MyST resolves a link from a linked page against the page's real folder."""
    import nbformat

    src = tmp / "docs"
    src.mkdir()
    for entry in DOCS.iterdir():
        if entry.suffix == ".md":
            shutil.copy(entry, src / entry.name)
        elif entry.name not in ("tutorials", "_build"):
            (src / entry.name).symlink_to(entry)
    (src / "tutorials").mkdir()
    for nb in NOTEBOOKS:
        if nb.name in UNEXECUTED:  # shown as stored (conf.py does not execute it either)
            shutil.copy(nb, src / "tutorials" / nb.name)
        else:
            nbformat.write(tutorial_runs(nb.name), src / "tutorials" / nb.name)
    return src


@pytest.fixture(scope="module")
def site(tmp_path_factory, tutorial_runs):
    """Build the site once; return (output directory, build log)."""
    for mod in ("sphinx", "myst_nb", "furo"):
        pytest.importorskip(mod, reason="the docs extra is not installed")
    tmp = tmp_path_factory.mktemp("site")
    src, out = _stage(tmp, tutorial_runs), tmp / "html"
    env = dict(os.environ, NBDIST_DOCS_EXECUTE="off", PYTHONUNBUFFERED="1")
    rc, log = _run_group([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html",
                          str(src), str(out)], BUILD_TIMEOUT, cwd=ROOT, env=env)
    (out.parent / "build.log").write_text(log)
    assert rc == 0, f"sphinx-build -W failed (rc={rc}); log in {out.parent / 'build.log'}:\n" \
                    f"{log[-8000:]}"
    return out, log


def _page(site, name):
    path = site[0] / f"{name}.html"
    assert path.is_file(), f"{name}.html was not built"
    return path.read_text(encoding="utf-8")


def _text(page):
    """Visible-ish text of a page: tags dropped, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", "", page))


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_site_builds_with_warnings_as_errors(site):
    _, log = site
    # -W already failed the build on any warning; this also catches a warning printed by a
    # subprocess in a format Sphinx did not count
    sphinx_warnings = [line for line in log.splitlines() if re.search(r": (WARNING|ERROR): ", line)]
    assert not sphinx_warnings, "\n".join(sphinx_warnings)


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
@pytest.mark.parametrize("name", PAGES)
def test_key_pages_exist(site, name):
    page = _page(site, name)
    assert "<h1>" in page


#: tutorials the site shows unexecuted (docs/conf.py's nb_execution_excludepatterns), and why
UNEXECUTED = {"12_from_this_laptop_to_a_cluster.ipynb": "needs a SLURM cluster and a kernel "
              "restart; tests/notebooks/test_tutorial_slurm.py runs it against the local SLURM"}


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_every_notebook_is_a_tutorial_page_with_outputs(site):
    assert NOTEBOOKS, "no notebooks/*.ipynb"
    index = _page(site, "tutorials")
    for nb in NOTEBOOKS:
        page = _page(site, f"tutorials/{nb.stem}")
        assert f'href="tutorials/{nb.stem}.html"' in index, f"{nb.name} missing from the toctree"
        if nb.name in UNEXECUTED:
            continue
        outputs = page.count('class="cell_output')
        assert outputs >= 1, f"{nb.name}: no executed output on its page"
    assert "Executing notebook failed" not in site[1]


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_quickstart_shows_real_outputs(site):
    text = _text(_page(site, "tutorials/01_quickstart"))
    assert "[rank 0] before all_reduce: [1.0, 1.0, 1.0]" in text
    assert "tensor([3., 3., 3.])" in text
    # the cell tagged raises-exception shows the remote error instead of stopping the build
    assert "ValueError" in text and "something went wrong on rank 1" in text
    assert "still here on rank 1" in text


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_api_reference_from_docstrings(site):
    page = _page(site, "api")
    ids = set(re.findall(r'id="([^"]+)"', page))
    expected = {"nbdist.start", "nbdist.attach", "nbdist.launch", "nbdist.Group", "nbdist.Group.run",
                "nbdist.Group.exec", "nbdist.Group.restart", "nbdist.current_group",
                "nbdist.errors.RemoteError", "nbdist.errors.RankDiedError",
                "nbdist.backends.register_backend", "nbdist.backends.resolve_backend",
                "module-nbdist.strategies", "nbdist.strategies.wrap", "module-nbdist.memory",
                "nbdist.memory.measure", "module-nbdist.lightning", "nbdist.lightning.fit",
                "module-nbdist.ui.magics", "module-nbdist.backends.store", "module-nbdist.runtime",
                "module-nbdist.wire", "module-nbdist.report", "module-nbdist.ui"}
    for optional in ("nbdist.bench", "nbdist.backends.shm", "nbdist.ui.widgets"):
        try:
            __import__(optional)
        except ImportError:
            continue
        expected.add(f"module-{optional}")
    assert not expected - ids, f"missing from the API reference: {sorted(expected - ids)}"
    # the docstrings themselves made it, not just the signatures
    assert "persistent group of" in _text(page)


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_install_and_platform_pages(site):
    install = _text(_page(site, "install"))
    for needle in ("pip install", "download.pytorch.org/whl/cpu", "conda env create -f environment.yml",
                   "conda-forge", "scripts/setup-venv.sh", "TORCH_CUDA_ARCH_LIST",
                   "BUILD_CUDA_EXTENSIONS=1", "repo2docker --no-build"):
        assert needle in install, needle
    platforms = _page(site, "platforms")
    table = platforms[platforms.index("<table"):platforms.index("</table>")]
    for needle in ("Linux x86_64", "macOS", "Windows", "CUDA", "gloo", "nccl", "nbstore",
                   "nbdist_shm", "tested", "untested"):
        assert needle in table, needle
    assert "Nothing in this project has run on a GPU" in _text(platforms)


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_pages_load_nothing_from_the_network(site):
    """Scripts, styles and images come from the site itself (the widget manager may still fetch
    third-party widget modules from its CDN; the tutorials use none)."""
    out = site[0]
    allowed = ()
    if not (out / "_static" / "widgets" / "embed-amd.js").is_file():
        assert shutil.which("npm") is None, "npm is here but the widget JavaScript was not fetched"
        allowed = ("https://cdnjs.cloudflare.com/ajax/libs/require.js/",  # myst-nb's defaults
                   "https://cdn.jsdelivr.net/npm/@jupyter-widgets/html-manager@")
    for path in out.rglob("*.html"):
        page = path.read_text(encoding="utf-8")
        remote = [url for url in re.findall(r'<(?:script|link|img)\b[^>]*\b(?:src|href)='
                                            r'"(https?://[^"]+)"', page)
                  if not url.startswith(allowed)]
        assert not remote, f"{path.relative_to(out)} loads {remote}"


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_widgets_render_from_local_javascript(site):
    out, _ = site
    pages = [p for p in (out / "tutorials").glob("*.html")
             if "application/vnd.jupyter.widget-view+json" in p.read_text(encoding="utf-8")]
    if not pages:
        pytest.skip("no tutorial displays a widget")
    if not (out / "_static" / "widgets" / "embed-amd.js").is_file():
        assert shutil.which("npm") is None, "npm is here but the widget JavaScript was not fetched"
        pytest.skip("npm is not available: widget JavaScript comes from the CDN")
    for path in pages:
        page = path.read_text(encoding="utf-8")
        assert "application/vnd.jupyter.widget-state+json" in page, f"{path.name}: no widget state"
        for js in ("require.js", "require-config.js", "embed-amd.js"):
            assert re.search(rf'src="\.\./_static/widgets/{re.escape(js)}', page), (path.name, js)
    fonts = list((out / "_static" / "widgets" / "@jupyter-widgets").glob("*.woff2"))
    assert fonts, "widget icon fonts missing"


@pytest.mark.timeout(30)
def test_environment_yml_structure():
    yaml = pytest.importorskip("yaml")
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    env = yaml.safe_load((ROOT / "environment.yml").read_text(encoding="utf-8"))
    assert env["name"] == "nbdist"
    assert env["channels"] == ["conda-forge"]
    deps = env["dependencies"]
    specs = [d for d in deps if isinstance(d, str)]
    names = {re.split(r"[\s=<>!\[]", s, maxsplit=1)[0] for s in specs}
    # the project's core dependencies, under their conda-forge names
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    core = {re.split(r"[\s=<>!\[;]", d, maxsplit=1)[0] for d in pyproject["project"]["dependencies"]}
    conda_name = {"torch": "pytorch"}
    assert {"python", "pip"} | {conda_name.get(c, c) for c in core} <= names, names
    assert "cpuonly" not in names and "torch" not in names  # not conda-forge package names
    pytorch = next(s for s in specs if s.split()[0] == "pytorch")
    assert "cpu" in pytorch, f"{pytorch!r} should select conda-forge's CPU build"
    pip_sections = [d["pip"] for d in deps if isinstance(d, dict) and "pip" in d]
    assert len(pip_sections) == 1
    installs_nbdist = [p for p in pip_sections[0]
                       if p.startswith("nbdist") or re.match(r"(-e\s+)?\.(\[[\w,]+\])?$", p)]
    assert installs_nbdist, f"the pip section does not install nbdist: {pip_sections[0]}"
    assert pyproject["project"]["name"] == "nbdist"


@pytest.mark.timeout(120)
def test_binder_dockerfile_installs_cpu_torch_and_nbdist():
    r2d = shutil.which("repo2docker") or str(Path(sys.executable).with_name("repo2docker"))
    if not Path(r2d).exists():
        pytest.skip("jupyter-repo2docker is not installed")
    rc, out = _run_group([r2d, "--no-build", "--debug", "--user-id", "1000", "--user-name", "jovyan",
                          str(ROOT)], 90, cwd=ROOT)
    assert rc == 0, out[-4000:]
    assert "python=3.11" in out  # binder/runtime.txt
    # binder/ wins over the root environment.yml (which is for conda users, not Binder)
    assert "environment.yml" not in re.sub(r"environment\.py-[\d.]+-linux-64\.lock", "", out)
    assert 'COPY --chown=1000:1000 src/binder/requirements.txt' in out
    assert 'pip install --no-cache-dir -r "binder/requirements.txt"' in out
    binder = (ROOT / "binder" / "requirements.txt").read_text(encoding="utf-8")
    reqs = [line.strip() for line in binder.splitlines()
            if line.strip() and not line.startswith("#")]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in reqs
    torch_pin = next(r for r in reqs if r.startswith("torch"))
    assert torch_pin.endswith("+cpu"), torch_pin
    constraints = (ROOT / "constraints-dev.txt").read_text(encoding="utf-8")
    constraint = next(line for line in constraints.splitlines() if line.startswith("torch=="))
    assert torch_pin == constraint + "+cpu", "binder's torch should match constraints-dev.txt"
    assert any(re.match(r"(-e\s+)?\.\[[\w,]*notebook[\w,]*\]$", r) for r in reqs), reqs


@pytest.mark.timeout(30)
def test_readme_has_a_binder_badge_opening_jupyterlab_on_the_tutorials():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    badge = re.search(r"\[!\[[^\]]*\]\(https://mybinder\.org/badge_logo\.svg\)\]\((https://mybinder"
                      r"\.org/v2/gh/[^)]+)\)", readme)
    assert badge, "no Binder badge in README.md"
    assert "urlpath=lab" in badge.group(1) and "notebooks" in badge.group(1)


@pytest.mark.timeout(BUILD_TIMEOUT + 60)
def test_architecture_page_draws_the_parts_and_links_the_runtime_docstring(site):
    page = _page(site, "architecture")
    text = _text(page)
    for part in ("nbdist.ui", "nbdist.lightning", "nbdist.bench", "nbdist.memory",
                 "nbdist.strategies", "nbdist.runtime", "nbdist.backends", "nbdist.wire",
                 "nbdist.errors", "nbdist.report", "Where does my change go?"):
        assert part in text, part
    # {py:mod}`nbdist.runtime` resolved to the API page (an unresolved one renders without a link)
    assert 'href="api.html#module-nbdist.runtime"' in page
