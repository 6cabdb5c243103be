"""nbdist's notes in a plain script (issue 35): the threads per rank go to stderr, so the script's
own first line on stdout is its own; the ``nbdist`` logger at WARNING silences them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

SCRIPT = ("import logging, sys, nbdist\n"
          "if sys.argv[1] == 'quiet':\n"
          "    logging.getLogger('nbdist').setLevel(logging.WARNING)\n"
          "with nbdist.start(2, backend='gloo', device='cpu') as g:\n"
          "    print('ready', g.run(lambda: 1))\n")


@pytest.mark.parametrize("mode", ["notes", "quiet"])
def test_a_scripts_stdout_is_its_own(mode):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # nbdist picks threads
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=100, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "ready [1, 1]", out.stdout
    assert ("nbdist: torch uses" in out.stderr) == (mode == "notes"), out.stderr
