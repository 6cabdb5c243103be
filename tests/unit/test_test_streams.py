"""scripts/test_streams.py splits the suite in two pytest processes (issue 39): every test runs in
exactly one of them, and a stale list stops the run instead of dropping tests."""
import importlib.util
import os
import pathlib

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
            if (e.is_dir() and e.name != "__pycache__")
            or (e.name.startswith("test_") and e.name.endswith(".py"))}
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
