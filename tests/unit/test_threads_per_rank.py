"""How many torch threads each rank gets: the cores this process may run on, not the machine's;
and where that note goes: stdout in a notebook, the ``nbdist`` logger elsewhere (stderr when no
logging is configured), nowhere once that logger is set to WARNING."""
import logging
import os
import sys

import pytest

from nbdist.runtime import current
from nbdist.runtime.launcher import threads_per_rank

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity: Linux")


@pytest.fixture
def one_core(monkeypatch):
    """This process pinned to one of its cores (as taskset -c 0 would), for the test."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(current, "_notes_said", set())
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    yield
    os.sched_setaffinity(0, allowed)


class _KernelStdout:
    """Stands for ipykernel's OutStream (what sys.stdout is in a notebook): keeps what is written."""

    def __init__(self):
        self.text = ""

    def write(self, text):
        self.text += text

    def flush(self):
        pass


_KernelStdout.__module__ = "ipykernel.iostream"
NOTE = "torch uses 1 thread per rank (1 core shared by 2 ranks)"


def test_threads_per_rank_counts_the_cores_this_process_may_use(one_core, caplog, capsys):
    caplog.set_level(logging.INFO, logger="nbdist")
    assert threads_per_rank({"threads": None, "env": None, "world_size": 2}) == 1
    assert [r.getMessage() for r in caplog.records if NOTE in r.getMessage()], caplog.records
    said = capsys.readouterr()
    assert NOTE not in said.out  # a script reading the program's own output does not get it


def test_in_a_notebook_the_note_goes_to_stdout(one_core, monkeypatch, caplog, capsys):
    out = _KernelStdout()
    monkeypatch.setattr(sys, "stdout", out)
    assert current.in_notebook()
    threads_per_rank({"threads": None, "env": None, "world_size": 2})
    monkeypatch.undo()
    assert NOTE in out.text
    assert not capsys.readouterr().err  # a note, not an error: Jupyter shows stderr in a pink box
    assert not [r for r in caplog.records if NOTE in r.getMessage()]


def test_without_logging_configured_the_note_goes_to_stderr(one_core, monkeypatch, capsys):
    monkeypatch.setattr(current.NOTES, "hasHandlers", lambda: False)  # a plain script's logging
    threads_per_rank({"threads": None, "env": None, "world_size": 2})
    said = capsys.readouterr()
    assert NOTE in said.err and NOTE not in said.out


def test_the_nbdist_logger_at_warning_silences_the_notes(one_core, monkeypatch, capsys):
    monkeypatch.setattr(current.NOTES, "hasHandlers", lambda: False)
    level = current.NOTES.level
    logging.getLogger("nbdist").setLevel(logging.WARNING)  # the documented way
    try:
        threads_per_rank({"threads": None, "env": None, "world_size": 2})
    finally:
        current.NOTES.setLevel(level)
    said = capsys.readouterr()
    assert NOTE not in said.err and NOTE not in said.out
