"""Fixtures for the browser tests: JupyterLab on localhost and headless Chromium (playwright).

JupyterLab runs from this venv with isolated config, runtime, settings and workspace folders, on a
port it binds itself (port 0, read back from its server-info file: no port picked here can be
taken by another process before the server binds it) with a random token, serving a temporary copy of ``notebooks/``. Chromium is the system
one (``chromium``, ``chromium-browser`` or ``google-chrome`` on PATH; CI links playwright's own
to ``/usr/bin/chromium``), else the one ``playwright install chromium`` downloaded; the tests
skip, saying so, when there is none. A Chromium that playwright cannot drive (too old for it)
fails with its path and version. Teardown shuts the kernels down through the server's API (a kernel stops its
groups on exit), then stops the server; what is still left of the processes it started is killed
by pid, so the suite's leak check finds nothing.
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import psutil
import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run",
                 "--disable-quic"]
REPO = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "browser"


class Lab:
    """A running JupyterLab server: ``url``, ``token``, ``root`` (the notebooks it serves)."""

    def __init__(self, url: str, token: str, root: pathlib.Path, proc: subprocess.Popen,
                 log: pathlib.Path):
        self.url, self.token, self.root, self.proc, self.log = url, token, root, proc, log

    def api(self, path: str, method: str = "GET"):
        """Call the server's REST API; return the decoded JSON (``None`` for no content)."""
        request = urllib.request.Request(f"{self.url}{path}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the server's log (for failure messages)."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _find_chromium():
    """A Chromium on PATH, else playwright's own download (None: neither)."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        bundled = p.chromium.executable_path
    return bundled if os.path.exists(bundled) else None


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """The Chromium the browser tests drive; they are skipped when there is none."""
    pytest.importorskip("playwright")
    found = _find_chromium()
    if found is None:
        pytest.skip(f"no Chromium: none of {', '.join(CHROMIUM_NAMES)} on PATH, and playwright "
                    "has not downloaded one. Install one: `apt-get install -y chromium` (CI does, "
                    "in .ci/run) or `python -m playwright install chromium`")
    return found


def _version(path: str) -> str:
    try:
        return subprocess.run([path, "--version"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or "version unknown"
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"version unknown ({err})"


@pytest.fixture
def artifacts() -> pathlib.Path:
    """``artifacts/browser/`` in the repository (git-ignored): the screenshots go there."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def jupyterlab(tmp_path, chromium_path):
    """JupyterLab serving a copy of ``notebooks/``; stopped, with its kernels, after the test."""
    root = tmp_path / "notebooks"
    shutil.copytree(REPO / "notebooks", root)
    dirs = {name: tmp_path / name for name in ("config", "runtime", "workspaces", "settings",
                                              "ipython")}
    for path in dirs.values():
        path.mkdir()
    notes = dirs["settings"] / "@jupyterlab" / "apputils-extension"
    notes.mkdir(parents=True)
    (notes / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(dirs["config"]),
               JUPYTER_RUNTIME_DIR=str(dirs["runtime"]), IPYTHONDIR=str(dirs["ipython"]),
               JUPYTER_PLATFORM_DIRS="1")
    token = secrets.token_hex(16)
    log = tmp_path / "jupyterlab.log"
    with open(log, "wb") as out:  # port 0: the server binds a free one, and says which below
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--allow-root",
             "--ServerApp.ip=127.0.0.1", "--ServerApp.port=0", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
             f"--LabApp.workspaces_dir={dirs['workspaces']}",
             f"--LabApp.user_settings_dir={dirs['settings']}", "--LabApp.news_url=None",
             "--LabApp.expose_app_in_browser=True"],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
    lab = Lab("", token, root, proc, log)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:  # the server info file in the runtime dir names the port it bound
                info = json.loads(next(dirs["runtime"].glob("jpserver-*.json")).read_text())
                lab.url = f"http://127.0.0.1:{info['port']}"
                lab.api("/api/status")
                break
            except (StopIteration, ValueError, KeyError, urllib.error.URLError, OSError):
                # not written yet, half written, or not answering yet
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not start (exit {proc.poll()}):\n"
                                       f"{lab.log_tail()}") from None
                time.sleep(0.2)
        yield lab
    finally:
        _stop(lab)


def _stop(lab: Lab) -> None:
    """Shut the kernels down, stop the server, then kill what is left of its processes."""
    try:
        started = psutil.Process(lab.proc.pid).children(recursive=True)
    except psutil.Error:
        started = []
    if lab.proc.poll() is None:
        try:
            for kernel in lab.api("/api/kernels"):
                lab.api(f"/api/kernels/{kernel['id']}", method="DELETE")
        except (urllib.error.URLError, OSError):
            pass  # the server is going down anyway; what it leaves is killed below
        lab.proc.terminate()
        try:
            lab.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            lab.proc.kill()
            lab.proc.wait(timeout=5)
    gone, alive = psutil.wait_procs(started, timeout=5)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


@pytest.fixture
def page(chromium_path):
    """A page in headless Chromium (1400x1400); the browser is closed after the test."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        try:
            browser = p.chromium.launch(executable_path=chromium_path, headless=True,
                                        args=CHROMIUM_ARGS)
        except PlaywrightError as err:
            raise RuntimeError(f"playwright could not start {chromium_path} "
                               f"({_version(chromium_path)}); an older Chromium than this "
                               "playwright supports? `python -m playwright install chromium` "
                               "gets a matching one") from err
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1400})
            yield context.new_page()
            context.close()
        finally:
            browser.close()
