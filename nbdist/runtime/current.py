"""Which groups exist in this process, and which one is current (the magics and widgets use it)."""
from __future__ import annotations

import logging
import sys
import weakref
from typing import Optional

#: nbdist's notes (the threads per rank, the backend picked): in a notebook they go to stdout (a
#: note, not an error: Jupyter shows stderr in a pink box); elsewhere through this logger -- to
#: stderr when the program configured no logging. ``logging.getLogger("nbdist").setLevel(
#: logging.WARNING)`` silences them everywhere.
NOTES = logging.getLogger("nbdist")
if NOTES.level == logging.NOTSET:
    NOTES.setLevel(logging.INFO)  # shown unless silenced: the root logger's WARNING would hide them
_live: "weakref.WeakSet" = weakref.WeakSet()  # every Group made in this process
_notes_said: set = set()
started_ids: set = set()  # ids of every group started in this process (leak checks use them)
_current = None  # the current Group


def current_group():
    """The group the magics and widgets use, or ``None``.

    A group started with :func:`start` / :func:`attach` (or ``%dist_start``, or the launcher
    widget) becomes current when no other group is running; :func:`use_group` picks one.
    Code, magics and widgets that call this share one object.
    """
    return _current


def set_current(group) -> None:
    """Record ``group`` as the current group (:func:`nbdist.use_group` checks it first)."""
    global _current
    _current = group


def say_once(note: Optional[str]) -> None:
    """Say an informational note once per process (:data:`NOTES`: stdout in a notebook, where
    libraries send notes elsewhere)."""
    if not note or note in _notes_said:
        return
    _notes_said.add(note)
    if not NOTES.isEnabledFor(logging.INFO):
        return
    if in_notebook():
        print(note, file=sys.stdout)
    elif NOTES.hasHandlers():
        NOTES.info(note)
    else:  # no logging configured: Python would drop an INFO record
        print(note, file=sys.stderr)


def in_notebook() -> bool:
    """Whether this process's stdout is a Jupyter kernel's (its cell output)."""
    return type(sys.stdout).__module__.startswith("ipykernel.")


