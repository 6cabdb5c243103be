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
  until every rank has answered; each rank copies the bytes out into a tensor of its own and closes
  its view before it runs anything, so its tensor is its own. Once every rank answered, the caller
  keeps the mapping for the next push of the same size (:func:`spare`, :func:`reuse`): writing into a
  new mapping faults in every page (under Wine 200 ms for 100 MiB, against 6-10 ms into one
  written before), so a new mapping per push made the push 5-8x Linux's. A call that did not end
  with every rank's answer and no error lets its mappings go instead (:func:`release`): a rank may
  still read.
  The spares are the caller's alone, bounded by :data:`SPARE_BYTES`, and go with the group.

Opening checks that the mapping exists and holds a handle while the view is made: a mapping whose
last holder died in between would otherwise be created anew, silently full of zeros.
"""
from __future__ import annotations

import mmap
import os
import sys
from collections import OrderedDict
from typing import Dict, Iterable, List, Optional, Tuple

from . import locks

#: segments are named mappings here (Windows), files elsewhere
NAMED = sys.platform == "win32"

#: bytes of pushed mappings kept for reuse once every rank let go (the oldest go first beyond)
SPARE_BYTES = 512 << 20

_held: Dict[str, mmap.mmap] = {}  # mappings this process created and keeps until release()
_spare: "OrderedDict[str, mmap.mmap]" = OrderedDict()  # held, and no other process has a view
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
    """Let go of the mappings this process created for ``paths`` (spare or not; those it does not
    hold are ignored): each disappears once no other process has a view of it."""
    for path in paths:
        with _held_lock:
            buf = _held.pop(path, None) or _spare.pop(path, None)
        if buf is not None:
            buf.close()  # nbdist exports no view of what it created: it only copies into it


def spare(paths: Iterable[str]) -> None:
    """Keep the held mappings ``paths`` for :func:`reuse`: every process that opened them has
    closed its view. Beyond :data:`SPARE_BYTES` the oldest spares are let go."""
    dropped = []
    with _held_lock:
        for path in paths:
            buf = _held.pop(path, None)
            if buf is not None:
                _spare[path] = buf
        total = sum(len(b) for b in _spare.values())
        while total > SPARE_BYTES:
            _, buf = _spare.popitem(last=False)
            total -= len(buf)
            dropped.append(buf)
    for buf in dropped:
        buf.close()


def reuse(prefix: str, nbytes: int) -> Optional[Tuple[str, mmap.mmap]]:
    """A spare mapping of exactly ``nbytes`` whose path starts with ``prefix``, held again (its
    pages already in memory), as ``(path, mapping)``; ``None`` if there is none."""
    with _held_lock:
        for path, buf in _spare.items():
            if path.startswith(prefix) and len(buf) == nbytes:
                del _spare[path]
                _held[path] = buf
                return path, buf
    return None


def held(prefix: str = "") -> List[str]:
    """The paths of the mappings this process still holds, spares included (starting with
    ``prefix``)."""
    with _held_lock:
        return [p for p in list(_held) + list(_spare) if name_of(p).startswith(prefix)]


def spares(prefix: str = "") -> List[str]:
    """The paths of the spare mappings (starting with ``prefix``), oldest first."""
    with _held_lock:
        return [p for p in _spare if name_of(p).startswith(prefix)]
