"""``%dist_debug``: post-mortem pdb on the rank that raised, from the notebook, as ``%debug`` does in
the kernel. The prompt reads the kernel's stdin (``input()``), one pdb command at a time; each runs
on the rank (``Group.debug``, :mod:`nbdist.runtime.postmortem`), where the traceback of the rank's
last failed call is kept until its next call. ``q`` ends the session."""
from __future__ import annotations

import sys

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ...errors import RemoteError
from .base import NbdistMagics, _rank, register_magics, usage

#: what ends the session (pdb's own words for leaving)
LEAVE = ("q", "quit", "exit", "c", "cont", "continue", "EOF")


@register_magics
@magics_class
class DebugMagics(NbdistMagics):
    """``%dist_debug [--rank R]``."""

    @line_magic
    @magic_arguments()
    @argument("--rank", type=_rank, metavar="R",
              help="the rank to debug (default: the root cause of the last RemoteError)")
    def dist_debug(self, line: str = "") -> None:
        """Open pdb on a rank's last failure, as %debug does: after a RemoteError, the failing
        rank's frames and variables (up, down, p, pp, l, where, args); q leaves."""
        args = self.parse(self.dist_debug, line)
        group = self.group
        rank = args.rank
        last = getattr(sys, "last_value", None)
        if rank is None:
            if not isinstance(last, RemoteError):
                raise UsageError("there is no RemoteError to debug: %dist_debug opens pdb on the "
                                 "rank that raised the last one (run after it, as %debug), or on "
                                 f"the rank you name with --rank R\n{usage(self.dist_debug)}")
            rank = last.root_cause.rank
        try:
            print(group.debug(None, rank), end="")
        except RemoteError as err:
            if err.root_cause.type_name != "LookupError":
                raise
            raise UsageError(err.root_cause.message) from None
        except ValueError as err:  # a rank outside the group
            raise UsageError(f"{err}\n{usage(self.dist_debug)}") from None
        while True:
            try:
                command = input(f"(Pdb rank {rank}) ")
            except (EOFError, KeyboardInterrupt):
                break
            if command.strip() in LEAVE:
                break
            print(group.debug(command, rank), end="")
