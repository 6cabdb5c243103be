"""The CI matrix for the public repository (.github/workflows/ci.yml) cannot run here; this checks
what can be checked by reading it: the matrix, CPU torch, and that it runs the README's test command
(issue 20). CONTRIBUTING.md says how it is kept correct by hand."""
import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]
CI = ROOT / ".github" / "workflows" / "ci.yml"


@pytest.mark.timeout(30)
def test_the_matrix_covers_three_systems_and_four_pythons_on_cpu_torch():
    job = yaml.safe_load(CI.read_text(encoding="utf-8"))["jobs"]["test"]
    matrix = job["strategy"]["matrix"]
    assert matrix["os"] == ["ubuntu-latest", "macos-latest", "windows-latest"]
    assert matrix["python"] == ["3.10", "3.11", "3.12", "3.13"]
    assert job["env"]["PIP_EXTRA_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    assert job["continue-on-error"] == "${{ matrix.os != 'ubuntu-latest' }}"  # Linux must pass


@pytest.mark.timeout(30)
def test_it_runs_the_readmes_test_command_and_chromium_only_on_linux():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"^(bash scripts/test\.sh)\s+#", readme, re.M).group(1)
    steps = yaml.safe_load(CI.read_text(encoding="utf-8"))["jobs"]["test"]["steps"]
    runs = [s.get("run", "").strip() for s in steps]
    assert command in runs
    readme_step = next(s for s in steps if s.get("run", "").strip() == command)
    assert readme_step["if"] == "runner.os != 'Windows'"
    chromium = [s for s in steps if "playwright install" in s.get("run", "")]
    assert len(chromium) == 1 and chromium[0]["if"] == "runner.os == 'Linux'"
    assert chromium[0]["run"].strip().endswith("playwright install --with-deps chromium")
    # which tests/browser/conftest.py finds when no Chromium is on PATH
    fixtures = (ROOT / "tests" / "browser" / "conftest.py").read_text(encoding="utf-8")
    assert "p.chromium.executable_path" in fixtures


@pytest.mark.timeout(30)
def test_contributing_says_it_has_not_run_and_is_kept_by_hand():
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    assert ".github/workflows/ci.yml" in text and "kept correct by hand" in text


@pytest.mark.timeout(30)
def test_the_windows_job_runs_the_same_suite_as_the_wine_run():
    """Issue 26: the matrix's Windows job runs what scripts/test-windows.sh runs under Wine."""
    steps = yaml.safe_load(CI.read_text(encoding="utf-8"))["jobs"]["test"]["steps"]
    (step,) = [s for s in steps if s.get("if") == "runner.os == 'Windows'"]
    ours = step["run"].strip().split(" -m pytest ", 1)[1]
    wine = (ROOT / "scripts" / "test-windows.sh").read_text(encoding="utf-8")
    (line,) = [ln for ln in wine.splitlines() if ln.startswith("wpy -m pytest ")]
    assert line.split("wpy -m pytest ", 1)[1] == ours + ' "$@"'
    # and the two streams it runs by default take the same options (test_streams adds -q)
    options = ours.split("-q ", 1)[1].split(" tests/unit", 1)[0]
    assert f'--windows "/usr/lib/wine/wine64 $ROOT/py/python.exe" \\\n    {options}\n' in wine
