"""Fixtures for the magics tests: one in-process IPython shell with nbdist's magics, and groups.

The shell is IPython's test shell (``start_ipython``), shared by the whole session. Groups are real
worker processes (world size 2, gloo, CPU). The suite-wide ``no_leaks`` check (tests/conftest.py)
runs after every test: a test that starts workers must stop them, unless they belong to a group
that existed before the test.
"""
from __future__ import annotations

import pytest
from IPython.testing import globalipapp
from IPython.testing.globalipapp import start_ipython

import nbdist
from nbdist.lightning import warmup as warm
from nbdist.ui import magics


@pytest.fixture(scope="session")
def shell():
    """IPython's in-process test shell, formatting every mime type, with ``%load_ext nbdist``."""
    ip = start_ipython() or globalipapp.get_ipython()  # None if another test started it
    ip.display_formatter.active_types = ip.display_formatter.format_types
    ip.run_line_magic("load_ext", "nbdist")
    warm.AUTO = False  # the session imports Lightning: keep its early import off other tests' ranks
    yield ip
    ip.run_line_magic("unload_ext", "nbdist")


@pytest.fixture
def dist_group(shell, shared_group):
    """The module's shared group, attached as the magics' current group (tests leave it usable)."""
    assert shared_group.state == "ready", "an earlier test broke the shared group"
    magics.use_group(shared_group)
    yield shared_group
    magics.use_group(None)


@pytest.fixture
def magic_group(shell):
    """A group of its own, started with ``%dist_start -n 2`` and stopped after the test."""
    magics.use_group(None)
    shell.run_line_magic("dist_start", "-n 2")
    group = magics.current_group()
    yield group
    group.stop()
    magics.use_group(None)


@pytest.fixture
def no_group(shell):
    """No current group during the test."""
    magics.use_group(None)


@pytest.fixture(autouse=True)
def autodist_off(request):
    """Whatever a test did, the next one starts with ``%autodist`` off."""
    yield
    if "shell" in request.fixturenames:
        for instance in request.getfixturevalue("shell").magics_manager.registry.values():
            if isinstance(instance, magics.DistMagics):
                instance.autodist_off()


@pytest.fixture
def panels(request):
    """Make panels through ``panels(factory, ...)``; after the test they are closed and a group
    the test left current is stopped (the module's shared group excepted)."""
    made = []
    nbdist.use_group(None)

    def make(factory, *args, **kwargs):
        panel = factory(*args, **kwargs)
        made.append(panel)
        return panel

    yield make
    for panel in made:
        panel.close()
    shared = (request.getfixturevalue("shared_group") if "shared_group" in request.fixturenames
              else None)
    group = nbdist.current_group()
    if group is not None and group is not shared:
        group.stop()
    nbdist.use_group(None)
