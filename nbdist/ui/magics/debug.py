"""``%dist_debug``: post-mortem pdb on the rank that raised, from the notebook, as ``%debug`` does in
the kernel. The prompt reads the kernel's stdin (``input()``), one pdb command at a time; each runs
on the rank (``Group.debug``, :mod:`nbdist.runtime.postmortem`), where the traceback of the rank's
last failed call is kept until its next call. ``q`` ends the session.

``%dist_debug NAME`` attaches to background job NAME paused at a breakpoint: the same prompt, each
command run by the rank's live pdb (:meth:`Job.debug <nbdist.Job.debug>`); ``c`` lets the job run
on, ``q`` ends it with an error, Ctrl-C (or an empty answer to EOF) leaves it paused."""
from __future__ import annotations

import sys

from IPython.core.error import UsageError
from IPython.core.magic import line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ...errors import RemoteError
from ...runtime.rankpdb import RESUME
from .base import NbdistMagics, _rank, register_magics, usage
from .jobs import find_job

#: what ends the session (pdb's own words for leaving)
LEAVE = ("q", "quit", "exit", "c", "cont", "continue", "EOF")


@register_magics
@magics_class
class DebugMagics(NbdistMagics):
    """``%dist_debug [NAME] [--rank R]``."""

    @line_magic
    @magic_arguments()
    @argument("name", nargs="?", metavar="NAME",
              help="a background job paused at a breakpoint: attach to its pdb")
    @argument("--rank", type=_rank, metavar="R",
              help="the rank to debug (default: the root cause of the last RemoteError, or the "
                   "job's first rank at a breakpoint)")
    def dist_debug(self, line: str = "") -> None:
        """Open pdb on a rank's last failure, as %debug does: after a RemoteError, the failing
        rank's frames and variables (up, down, p, pp, l, where, args); q leaves. With NAME:
        attach to background job NAME paused at a breakpoint (c continues it, q ends it)."""
        args = self.parse(self.dist_debug, line)
        if args.name is not None:
            _attach(find_job(args.name), args.rank)
            return
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


def _attach(job, rank) -> None:
    """The prompt of ``%dist_debug NAME``: one command at a time to the job's paused rank."""
    try:
        text = job.debug(None, rank)
    except LookupError as err:
        raise UsageError(str(err)) from None
    rank = rank if rank is not None else min(job.paused or {0: ""})
    print(f"nbdist: attached to rank {rank} of job {job.name!r}, at a breakpoint "
          f"({(job.paused or {}).get(rank, '')}); c continues the job, q ends it.")
    print(text, end="")
    while True:
        try:
            command = input(f"(Pdb rank {rank}) ")
        except (EOFError, KeyboardInterrupt):
            print(f"nbdist: detached; job {job.name!r} stays paused (%dist_debug {job.name} "
                  "attaches again).")
            return
        try:
            print(job.debug(command, rank), end="")
        except KeyboardInterrupt:  # the command runs on: its next prompt pauses the job again
            print(f"nbdist: stopped waiting for rank {rank}; job {job.name!r} goes on.")
            return
        except LookupError:  # the job ended meanwhile
            command = "c"
        word = command.strip().split(" ")[0]
        if word in RESUME or rank not in (job.paused or {}):
            how = "ends with an error (pdb quit)" if word in ("q", "quit", "exit") else "runs on"
            print(f"nbdist: rank {rank} left pdb; job {job.name!r} {how} (%dist_wait "
                  f"{job.name} waits for it).")
            return
