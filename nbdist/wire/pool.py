"""Reusable shared-memory segments for results (worker -> caller).

Most of the cost of handing a large tensor to another process is not the copy but the fresh pages:
allocating and zeroing 100 MiB of tmpfs pages costs several times a memcpy. So a worker keeps the
segments it made in a pool, still mapped, and copies the next result of a similar size into one
that the caller has released: a plain memcpy into pages that already exist.

The caller maps a pooled segment with ``mmap`` and builds the tensor on that buffer; when the last
tensor (or view) using it is freed, a finalizer tells the group, which tells the worker with its
next request that the segment is free again. Segments are unlinked when the group stops.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from typing import Callable, Dict, List, Optional, Tuple

from . import locks, mappings
from .segments import write_all

POOL_BYTES = 2 << 30  # at most this much idle shared memory kept per worker
_hooks: Dict[str, Callable[[str], None]] = {}
_hooks_lock = locks.make("pool")


def set_release_hook(group_id: str, hook: Optional[Callable[[str], None]]) -> None:
    """Route "segment free again" notices of group ``group_id`` to ``hook(path)`` (None: drop)."""
    with _hooks_lock:
        if hook is None:
            _hooks.pop(group_id, None)
        else:
            _hooks[group_id] = hook


def _released(path: str) -> None:
    gid = os.path.basename(path).split("-")[1]
    with _hooks_lock:
        hook = _hooks.get(gid)
    if hook is not None:
        hook(path)


_claims = threading.local()


@contextlib.contextmanager
def claiming():
    """Collect the pooled segments unpickled (claimed) in this thread within the block: if the
    unpickling fails, the ones never claimed must be given back by the caller; the claimed ones
    are given back by their tensors' finalizers."""
    previous = getattr(_claims, "paths", None)
    _claims.paths = claimed = []
    try:
        yield claimed
    finally:
        _claims.paths = previous


def rebuild_pooled(path: str, nbytes: int, dtype, shape, requires_grad: bool, is_param: bool):
    """Caller side: a tensor on a pooled segment; its release is reported when it is freed."""
    import torch

    claimed = getattr(_claims, "paths", None)
    if claimed is not None:
        claimed.append(path)

    if mappings.NAMED:  # Windows: the rank's mapping, which it holds while it lends it
        buf = mappings.open_existing(path, nbytes)
    else:
        fd = os.open(path, os.O_RDWR)
        try:
            buf = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    weakref.finalize(buf, _released, path)
    tensor = torch.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
    del buf  # the tensor's storage holds the buffer; the finalizer runs when the storage dies
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def copy_into(buf: mmap.mmap, src, nbytes: int) -> None:
    """Copy ``nbytes`` of contiguous CPU tensor ``src`` to the start of ``buf``, with libc's
    memmove: a tensor's ``copy_`` moved those bytes at two thirds of memmove's speed on one
    thread (benchmarks/bench_tensor.py, the memcpy rows), and the pull is that copy."""
    dst = ctypes.c_char.from_buffer(buf)
    try:
        ctypes.memmove(ctypes.addressof(dst), src.data_ptr(), nbytes)
    finally:
        del dst  # an exported pointer would keep the mmap from closing


class SegmentPool:
    """Worker side: segments by path, each ``[size, mmap, lent]``."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._segments: Dict[str, list] = {}
        self._count = 0

    def release(self, paths: List[str]) -> None:
        """The caller no longer uses these segments."""
        for path in paths:
            entry = self._segments.get(path)
            if entry is not None:
                entry[2] = False

    def store(self, data) -> Tuple[str, int]:
        """Copy the bytes of contiguous CPU tensor ``data`` into a segment; return (path, nbytes)."""
        import torch

        nbytes = data.numel() * data.element_size()
        src = data.view(-1).view(torch.uint8)
        for path, entry in self._segments.items():
            size, buf, lent = entry
            if not lent and nbytes <= size <= 2 * nbytes:
                copy_into(buf, src, nbytes)
                entry[2] = True
                return path, nbytes
        self._trim(nbytes)
        self._count += 1
        path = f"{self.prefix}{os.getpid()}-p{self._count}"
        if mappings.NAMED:  # Windows: a named mapping, gone with the last process that holds it
            buf = mappings.create(path, nbytes, keep=False)
            copy_into(buf, src, nbytes)
            self._segments[path] = [nbytes, buf, True]
            return path, nbytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            write_all(fd, memoryview(src.numpy()))
            buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        self._segments[path] = [nbytes, buf, True]
        return path, nbytes

    def _trim(self, incoming: int) -> None:
        total = sum(e[0] for e in self._segments.values()) + incoming
        for path in [p for p, e in self._segments.items() if not e[2]]:
            if total <= POOL_BYTES:
                break
            size, buf, _ = self._segments.pop(path)
            buf.close()
            total -= size
            if mappings.NAMED:
                continue  # closed: Windows removes it with its last holder
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
