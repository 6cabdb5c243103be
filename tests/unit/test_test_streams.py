"""scripts/test_streams.py splits the suite in two pytest processes (issue 39): every test runs in
exactly one of them, and a stale list stops the run instead of dropping tests."""
import importlib.util
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("test_streams_script",
                                                  ROOT / "scripts" / "test_streams.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _paths(args):
    return {a for a in args if not a.startswith("-")}, \
        {a.split("=", 1)[1] for a in args if a.startswith("--ignore=")}


@pytest.mark.timeout(30)
def test_every_test_folder_and_integration_module_runs_in_exactly_one_stream():
    streams = dict(_load().streams())
    assert list(streams) == ["kernels", "ranks"]
    kernels, kernels_ignored = _paths(streams["kernels"])
    ranks, ranks_ignored = _paths(streams["ranks"])
    assert not kernels_ignored and ranks == {"tests/integration"}
    tops = {f"tests/{e.name}" for e in os.scandir(ROOT / "tests")
            if not e.name.startswith((".", "__")) and (
                e.is_dir() or (e.name.endswith(".py") and (e.name.startswith("test_")
                                                           or e.name.endswith("_test.py"))))}
    moved = {p for p in kernels if p.startswith("tests/integration/")}
    assert kernels - moved == tops - {"tests/integration"}
    assert moved == ranks_ignored and all((ROOT / p).is_file() for p in moved)
    # every cluster the suite starts lives in the kernels stream, with the tutorials that start them
    for name in ("test_engine_slurm.py", "test_engine_ray.py", "test_attach_slurm.py"):
        assert f"tests/integration/{name}" in moved


@pytest.mark.timeout(30)
def test_a_listed_module_that_does_not_exist_stops_the_run(monkeypatch):
    module = _load()
    monkeypatch.setattr(module, "WITH_KERNELS", [*module.WITH_KERNELS, "test_gone.py"])
    with pytest.raises(SystemExit, match=r"WITH_KERNELS names \['tests/integration/test_gone.py'\], "
                                         "which do not exist; update the list"):
        module.streams()


@pytest.mark.timeout(30)
def test_it_takes_no_test_arguments_and_says_where_they_go():
    module = _load()
    for argv in (["tests/unit"], ["-x"], ["--serial", "-k", "x"], ["--windows"],
                 ["--windows", " "]):
        with pytest.raises(SystemExit, match=r"takes only --serial, or --windows PYTHON and pytest "
                                             r"options; to run some tests, pass them to one "
                                             r"pytest: bash scripts/test.sh ARGS \(bash "
                                             r"scripts/test-windows.sh ARGS for the Windows "
                                             r"suite\)"):
            module.main(argv)


@pytest.mark.timeout(30)
def test_the_windows_streams_are_the_two_folders_the_windows_suite_runs():
    streams = dict(_load().WINDOWS_STREAMS)
    assert streams == {"unit": ["tests/unit"], "windows": ["tests/windows"]}
    assert all((ROOT / path).is_dir() for paths in streams.values() for path in paths)
    script = (ROOT / "scripts" / "test-windows.sh").read_text(encoding="utf-8")
    assert "tests/unit tests/windows" in script  # the one-pytest way runs the same two


@pytest.mark.timeout(30)
def test_pytests_own_module_names_and_no_hidden_entries_are_collected(tmp_path, monkeypatch):
    module = _load()
    tests = tmp_path / "tests"
    (tests / "integration").mkdir(parents=True)
    for name in module.WITH_KERNELS:
        (tests / "integration" / name).write_text("")
    for name in ("unit", ".hidden", "__pycache__"):
        (tests / name).mkdir()
    for name in ("test_a.py", "b_test.py", "conftest.py", "helpers.py"):
        (tests / name).write_text("")
    monkeypatch.setattr(module, "ROOT", str(tmp_path))
    kernels = dict(module.streams())["kernels"]
    assert [p for p in kernels if not p.startswith("tests/integration/")] == \
        ["tests/b_test.py", "tests/test_a.py", "tests/unit"]


DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("streams", {script!r})
streams = importlib.util.module_from_spec(spec)
spec.loader.exec_module(streams)
common = ["-p", "no:cacheprovider", "--rootdir", {root!r}, "-c", {ini!r}]
streams.streams = lambda: [("one", [{first!r}, *common]), ("two", [{second!r}, *common])]
sys.exit(streams.run())
"""


def _driver(driver, first, second, tmp_path, ini):
    driver.write_text(DRIVER.format(script=str(ROOT / "scripts" / "test_streams.py"),
                                    first=str(first), second=str(second), root=str(tmp_path),
                                    ini=str(ini)))


POSIX = pytest.mark.skipif(not hasattr(os, "killpg"), reason="two streams need process groups "
                           "(POSIX); elsewhere the script runs one pytest")


@pytest.mark.timeout(120)
@POSIX
@pytest.mark.parametrize("second, status", [("pass", 0), ("fail", 1)])
def test_the_exit_status_is_zero_only_when_both_streams_pass(tmp_path, second, status):
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    ok = tmp_path / "test_ok.py"
    ok.write_text("def test_ok():\n    pass\n")
    other = tmp_path / f"test_{second}.py"
    other.write_text(f"def test_it():\n    assert {second == 'pass'}\n")
    driver = tmp_path / "driver.py"
    _driver(driver, ok, other, tmp_path, ini)
    done = subprocess.run([sys.executable, str(driver)], capture_output=True, text=True, timeout=90)
    assert done.returncode == status, (done.stdout, done.stderr)
    assert f"[two] exit status {status} after" in done.stdout and "[one] 1 passed" in done.stdout


WINDOWS_DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("streams", {script!r})
streams = importlib.util.module_from_spec(spec)
spec.loader.exec_module(streams)
streams._cores = lambda: {cores}
sys.exit(streams.main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
@POSIX
@pytest.mark.parametrize("cores", [2, 1])
def test_windows_runs_each_folder_in_its_own_stream_with_the_python_and_options_given(tmp_path,
                                                                                     cores):
    for folder in ("unit", "windows"):
        (tmp_path / "tests" / folder).mkdir(parents=True)
        (tmp_path / "tests" / folder / f"test_{folder}.py").write_text(
            "import sys\n\ndef test_it():\n    assert sys.flags.int_max_str_digits == 5678\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    driver = tmp_path / "driver.py"
    driver.write_text(WINDOWS_DRIVER.format(script=str(ROOT / "scripts" / "test_streams.py"),
                                            cores=cores))
    python = f"{sys.executable} -X int_max_str_digits=5678"  # more than one word, as Wine's
    done = subprocess.run([sys.executable, str(driver), "--windows", python, "-p",
                           "no:cacheprovider", "-rA"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, (done.stdout, done.stderr)
    for folder in ("unit", "windows"):
        test = f"PASSED tests/{folder}/test_{folder}.py::test_it"
        if cores > 1:  # two streams
            assert f"[{folder}] {test}" in done.stdout
            assert f"[{folder}] exit status 0 after" in done.stdout
        else:  # one pytest, both folders, its output still through a pipe (as Wine needs)
            assert f"[suite] {test}" in done.stdout and "[suite] 2 passed" in done.stdout


@pytest.mark.timeout(90)
@POSIX
def test_a_sigterm_stops_both_streams_and_leaves_none_running(tmp_path):
    slow = tmp_path / "test_slow.py"
    slow.write_text("import time\n\ndef test_slow():\n    time.sleep(120)\n")
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\n")
    driver = tmp_path / "driver.py"
    _driver(driver, slow, slow, tmp_path, ini)
    launcher = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    import psutil

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # both streams are in their slow test
        streams = [p for p in psutil.Process(launcher.pid).children()
                   if "pytest" in " ".join(p.cmdline())]
        if len(streams) == 2:
            break
        time.sleep(0.2)
    assert len(streams) == 2
    time.sleep(3)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, (out, err)
    assert "test_streams: interrupted; stopping both streams" in err
    assert not [p for p in streams if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
