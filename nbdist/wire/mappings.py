"""Windows' shared memory: named file mappings, the form a segment takes where there is no
``/dev/shm``.

On Windows a segment is a named, pagefile-backed file mapping (``mmap.mmap(-1, size,
tagname=NAME)``), named as the file would be (``nbdist-<group id>-<who>-...``). Windows keeps a
mapping exactly as long as some process holds a handle or a view of it, and closes every handle of
a process that ends, however it ends. So nothing can be left behind: a rank killed in the middle of
a transfer, or a kernel killed by SIGKILL, takes its share of every mapping with it, and the
mapping disappears with its last user. (A mapped *file* would be the opposite: Windows refuses to
delete a file that a process has mapped, so a killed rank's files would stay.)

Who holds what:

* results, rank -> caller: the rank's pool keeps the mapping it copied the result into
  (:class:`nbdist.wire.pool.SegmentPool`); the caller opens it (:func:`open_existing`) while the
  rank still holds it -- the rank lends it until the caller's tensor is freed -- and builds the
  tensor on its own view.
* values pushed, caller -> ranks: the caller creates the mapping (:func:`create`) and holds it
  until every rank has answered (:func:`release`, called where POSIX unlinks the file); each rank
  maps it copy-on-write, so its tensor is its own.

Opening checks that the mapping exists and holds a handle while the view is made: a mapping whose
last holder died in between would otherwise be created anew, silently full of zeros.
"""
from __future__ import annotations

import mmap
import os
import sys
from typing import Dict, Iterable, List

from . import locks

#: segments are named mappings here (Windows), files elsewhere
NAMED = sys.platform == "win32"

_held: Dict[str, mmap.mmap] = {}  # mappings this process created and keeps until release()
_held_lock = locks.make("segments", module_level=True)  # a leaf: nothing is taken under it


def name_of(path: str) -> str:
    """The mapping's name: the segment's file name, without its folder."""
    return os.path.basename(path)


def create(path: str, nbytes: int, keep: bool = True) -> mmap.mmap:
    """A new mapping of ``nbytes`` named after ``path`` (kept by this process until
    :func:`release` when ``keep``)."""
    buf = mmap.mmap(-1, nbytes, tagname=name_of(path))
    if keep:
        with _held_lock:
            _held[path] = buf
    return buf


def open_existing(path: str, nbytes: int, copy: bool = False) -> mmap.mmap:
    """A view of the existing mapping named after ``path``; ``copy``: copy-on-write, so writes
    stay in this process. Raises ``FileNotFoundError`` when no process holds it any more."""
    import _winapi

    access = _winapi.FILE_MAP_COPY if copy else _winapi.FILE_MAP_WRITE
    try:
        handle = _winapi.OpenFileMapping(access, False, name_of(path))
    except OSError as err:
        raise FileNotFoundError(f"shared memory {name_of(path)!r} is gone: the process that "
                                f"made it ended before it was read ({err})") from err
    try:  # our handle keeps it alive while the view is made
        return mmap.mmap(-1, nbytes, tagname=name_of(path),
                         access=mmap.ACCESS_COPY if copy else mmap.ACCESS_WRITE)
    finally:
        _winapi.CloseHandle(handle)


def release(paths: Iterable[str]) -> None:
    """Let go of the mappings this process created for ``paths`` (those it does not hold are
    ignored): each disappears once no other process has a view of it."""
    for path in paths:
        with _held_lock:
            buf = _held.pop(path, None)
        if buf is not None:
            buf.close()  # nbdist exports no view of what it created: it only copies into it


def held(prefix: str = "") -> List[str]:
    """The paths of the mappings this process still holds (starting with ``prefix``)."""
    with _held_lock:
        return [p for p in _held if name_of(p).startswith(prefix)]
