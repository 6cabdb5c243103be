"""Shared-memory segments: where they live, how they are named, written and removed.

Every segment nbdist creates is named ``nbdist-<group id>-<who>-...``. On Linux and macOS it is a
file in ``/dev/shm`` (a temp dir where there is none), so a group can remove everything it made,
and the next start on the machine can remove what a caller killed by SIGKILL left behind
(:func:`sweep_orphans`). On Windows it is a named file mapping (:mod:`.mappings`), which Windows
removes with its last user, however that user ends: there is never anything to sweep.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
from typing import List

import psutil

from . import mappings

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
#: whether a local group's large tensors travel through shared memory beside the message: files in
#: :data:`SHM_DIR`, or on Windows named mappings (:mod:`.mappings`; a *file* a process has mapped
#: cannot be deleted there, so a killed rank's files would stay, but a mapping goes with its last
#: user). Everywhere: ranks on other hosts (attached groups) get the bytes inside the message.
SHARED_FILES = True
SHM_MIN_BYTES = 1 << 16
#: chooses how a local group's large tensors travel: ``shared`` (shared memory beside the
#: message) or ``message`` (inside it)
ENV_VAR = "NBDIST_TENSORS"


def shared_files(environ=None) -> bool:
    """Whether a local group's large tensors travel as shared files: ``NBDIST_TENSORS`` in
    ``environ`` (default: this process's environment), else where the platform allows it. An
    unknown value, or ``shared`` on Windows, is refused, naming it."""
    value = (os.environ if environ is None else environ).get(ENV_VAR, "")
    usable = ("shared", "message")
    if not value:
        return True
    if value not in usable:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(map(repr, usable))}, got "
                         f"{value!r}; unset it for the default ('shared').")
    return value == "shared"


def shm_prefix(group_id: str, who: str) -> str:
    """The file-name prefix for segments a group's member ``who`` creates."""
    return os.path.join(SHM_DIR, f"nbdist-{group_id}-{who}-")


def leftover_segments(group_id: str) -> List[str]:
    """Segment files of group ``group_id`` that still exist (on Windows: the mappings of that
    group this process still holds)."""
    if mappings.NAMED:
        return mappings.held(f"nbdist-{group_id}-")
    return glob.glob(os.path.join(SHM_DIR, f"nbdist-{group_id}-*"))


def remove_segments(paths) -> None:
    """Unlink segment files, ignoring those already gone (on Windows: let go of the mappings)."""
    if mappings.NAMED:
        mappings.release(paths)
        return
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def let_go(paths, answered: bool) -> None:
    """A request's segments, once its call is over: removed -- except on Windows after every
    target rank answered without error (``answered``), where each rank has copied its tensors out
    and closed its view, so the mappings are kept for the next request's tensors of the same size
    (:func:`nbdist.wire.mappings.spare`; they go with the group)."""
    if mappings.NAMED and answered:
        mappings.spare(paths)
        return
    remove_segments(paths)


def write_all(fd: int, view: memoryview) -> None:
    """Write all of ``view`` to ``fd``. Into tmpfs, write() allocates pages in bulk: faster than
    faulting them in through an mmap, and one copy only."""
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:done + (1 << 30)])


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists (another user's process counts). Not ``os.kill(pid, 0)``: on Windows
    that terminates the process."""
    return psutil.pid_exists(pid)


def _ours(path: str) -> bool:
    getuid = getattr(os, "getuid", None)
    try:
        return getuid is None or os.stat(path).st_uid == getuid()  # Windows: a per-user temp dir
    except OSError:
        return False


def sweep_orphans() -> List[str]:
    """Remove what groups of callers that were killed (SIGKILL: no cleanup ran) left behind: their
    temp dir ``nbdist-<id>-p<pid>-*`` and their segments ``nbdist-<id>-*``. Returns what it removed.

    Only this user's files are touched: on a shared machine (JupyterHub, a lab server) another
    user's leftovers in the sticky ``/dev/shm`` are theirs to remove, and never stop a start.
    """
    removed: List[str] = []
    for path in glob.glob(os.path.join(tempfile.gettempdir(), "nbdist-*-p*-*")):
        parts = os.path.basename(path).split("-")
        if len(parts) < 4 or not parts[2][1:].isdigit() or not _ours(path):
            continue
        pid = int(parts[2][1:])
        if pid == os.getpid() or _alive(pid):
            continue
        for seg in leftover_segments(parts[1]):
            if not _ours(seg):
                continue
            try:
                os.unlink(seg)
                removed.append(seg)
            except OSError:  # gone meanwhile, or not ours to remove after all
                pass
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
