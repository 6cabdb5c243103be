"""Post-mortem pdb on a rank (issue 27), as IPython's ``%debug`` does in the kernel.

A rank keeps the exception of its last failed request -- its traceback, frames and variables --
until its next request (:class:`~nbdist.runtime.rankserver._Worker`). ``Group.debug(command,
rank)`` (what ``%dist_debug`` runs, one command per prompt) hands a pdb command to that rank, which
runs it in a :class:`PostMortem` (a ``pdb.Pdb`` over the kept traceback, writing into a buffer) and
returns what pdb printed. ``up``, ``down``, ``p``, ``pp``, ``l``, ``where``, ``args`` work on the
rank's frames as they do in a local post-mortem; ``q`` (or ``c``) ends the session in the notebook.
The requests that carry the commands keep the failure (they are not "the next call").
"""
from __future__ import annotations

import io
import pdb
from typing import Optional

from .stacks import SERVING

#: what ``%dist_debug`` says when the rank has no failure kept
NOTHING_TO_DEBUG = ("rank {rank} has no failure to debug: its last call did not fail on it (a rank "
                    "keeps the traceback of its last failed call until its next call)")


class PostMortem:
    """A pdb session over ``exc``'s traceback, the frames of nbdist's serving loop left out; it
    starts in the frame that raised."""

    def __init__(self, exc: BaseException):
        self.exc = exc
        self.out = io.StringIO()
        self.pdb = pdb.Pdb(stdin=io.StringIO(), stdout=self.out, nosigint=True)
        self.pdb.prompt = ""
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None and \
                tb.tb_frame.f_code.co_filename.startswith(SERVING):
            tb = tb.tb_next
        self.pdb.reset()
        self.pdb.setup(None, tb)

    def run(self, command: Optional[str]) -> str:
        """What pdb prints for ``command`` (``None``: the exception and where it was raised)."""
        if command is None:
            self.out.write(f"{type(self.exc).__name__}: {self.exc}\n")
            self.pdb.print_stack_entry(self.pdb.stack[self.pdb.curindex])
        else:
            self.pdb.onecmd(command)
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return text
