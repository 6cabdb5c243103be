"""Advice names the options as the caller wrote the call: start()'s keywords, or a magic's own
options while the magic runs (nbdist.runtime.advice)."""
import logging
import threading

import pytest

from nbdist.runtime.advice import option, option_names
from nbdist.runtime.launcher import threads_per_rank
from nbdist.ui.magics.base import START_OPTIONS

pytestmark = pytest.mark.timeout(30)


def test_keywords_by_default_and_the_magics_options_inside_the_block():
    assert option("init_timeout") == "init_timeout="
    with option_names(START_OPTIONS):
        assert option("init_timeout") == "--init-timeout S"
        assert option("max_world_size") == "--max-world-size N"
        assert option("backend") == "backend="  # not mapped: the keyword
        seen = []
        other = threading.Thread(target=lambda: seen.append(option("threads")))
        other.start()
        other.join()
        assert seen == ["threads="]  # another thread is not inside the magic
    assert option("init_timeout") == "init_timeout="


def test_the_threads_note_names_the_magics_option(caplog, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    caplog.set_level(logging.INFO, logger="nbdist")  # outside a notebook: the nbdist logger
    opts = {"threads": None, "env": None, "world_size": 997}  # a note no other test prints
    with option_names(START_OPTIONS):
        threads_per_rank(opts)
    assert "shared by 997 ranks); pass --threads N to change." in caplog.text
