"""Which groups exist in this process, and which one is current (the magics and widgets use it)."""
from __future__ import annotations

import sys
import weakref
from typing import Optional

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
    """Print an informational note once per process, on stdout: Jupyter shows stderr in a pink
    box meant for errors, and a note such as the threads per rank is not one."""
    if note and note not in _notes_said:
        _notes_said.add(note)
        print(note, file=sys.stdout)


