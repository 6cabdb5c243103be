"""The shared-memory segment of one ``nbdist_shm`` group: layout, rendezvous and clean-up.

Layout of ``/dev/shm/nbdist-shm-<id>`` (``<id>``: 16 random hex digits chosen by rank 0)::

    header      4 KiB   magic, world size, slot size, a random nonce
    control     world_size blocks of CTRL bytes, one per rank, written only by its rank:
                  +0  phase counter (uint32, a futex word)       +8  pid
                  +16 process start time                          +24 abort flag
                  +32 two fingerprints (8 int64 each, one per phase parity)
                  +160 two meta arrays (int64 x world_size each, one per phase parity)
                  then an abort message (1 KiB, UTF-8)
    data        world_size slots of ``slot_bytes``, each split in two halves (phase parity)

Rendezvous (through the group's c10d store, once per group): every rank publishes its host
identity (hostname and kernel boot id); rank 0 checks they are all equal, creates the file
(``O_EXCL``, so two groups never share one), fills the header and publishes the name; the
others map it, check the header and publish that they are attached. Rank 0 then *unlinks the
file*: the memory lives on while mapped, and nothing can be left in ``/dev/shm`` after a
crash. Every rank also unlinks it (ignoring "not found") on failure, on shutdown and at exit,
which covers rank 0 dying during the rendezvous. The store keys are deleted afterwards.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import platform
import secrets
import shutil
import socket
import weakref
from datetime import timedelta

import torch

from .errors import ShmBackendError
from .sync import process_start_time, usable_cores

__all__ = ["DEFAULT_SLOT_BYTES", "MIN_DEFAULT_SLOT_BYTES", "SHM_DIR", "Segment",
           "default_slot_bytes", "host_identity", "open_segment"]

SHM_DIR = "/dev/shm"
"""Where segments are created (a tmpfs on Linux)."""

DEFAULT_SLOT_BYTES = 32 << 20
"""Shared memory per rank and group (two halves of 16 MiB: the chunk size of large ops), when
``slot_bytes`` is not given and :data:`SHM_DIR` has room (see :func:`default_slot_bytes`).
Pages are only allocated when touched, so a group that moves small tensors uses little."""

MIN_DEFAULT_SLOT_BYTES = 1 << 20
"""The smallest slot the default picks on a small :data:`SHM_DIR` (below, the group is refused)."""

_ABORT_TEXT = 1024
_MAGIC = int.from_bytes(b"NBDSHM01", "little")
_HEADER = 4096
_FP_WORDS = 8
_KEY = "nbdist_shm"
_MACHINES = ("x86_64", "AMD64", "amd64")


def _align(n, a):
    return (n + a - 1) // a * a


def _boot_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def host_identity():
    """What must be equal on all ranks of a group: the hostname and the kernel's boot id."""
    return {"host": socket.gethostname(), "boot_id": _boot_id()}


class Segment:
    """A mapped segment; accessors for the counters, identities, fingerprints and slots.

    ``cores``: what :func:`~nbdist.backends.shm.sync.usable_cores` answered on rank 0 when it
    created the segment. Every rank sizes its chunks by this one answer: ranks pinned to
    different cores would otherwise cut a large tensor differently and read each other's slots
    out of step."""

    def __init__(self, path, fd, world_size, slot_bytes, create):
        """Map ``fd`` (of ``path``); ``create``: size the file and write the header first."""
        self.path, self.world_size, self.slot_bytes = path, world_size, slot_bytes
        self.half_bytes = slot_bytes // 2
        self.cores = usable_cores()  # rank 0's stays; the others take it from the rendezvous
        self.ctrl_bytes = _align(32 + 2 * 8 * _FP_WORDS + 2 * 8 * world_size + _ABORT_TEXT, 128)
        self.data_offset = _align(_HEADER + world_size * self.ctrl_bytes, 4096)
        self.nbytes = self.data_offset + world_size * slot_bytes
        if create:
            os.ftruncate(fd, self.nbytes)
        self._mm = mmap.mmap(fd, self.nbytes)
        self._header = (ctypes.c_int64 * 8).from_buffer(self._mm, 0)
        self._ctrl = [(ctypes.c_int64 * (self.ctrl_bytes // 8)).from_buffer(
            self._mm, _HEADER + r * self.ctrl_bytes) for r in range(world_size)]
        data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=self.data_offset,
                                count=world_size * slot_bytes)
        self._halves = [[data[r * slot_bytes + h * self.half_bytes:][:self.half_bytes]
                         for h in (0, 1)] for r in range(world_size)]
        self._meta = 4 + 2 * _FP_WORDS  # int64 index of the meta arrays in a control block
        self._text = (32 + 2 * 8 * _FP_WORDS + 2 * 8 * world_size)  # byte offset of the message
        self._finalizer = weakref.finalize(self, _unlink, path)

    # -- header ----------------------------------------------------------------------------
    def write_header(self, nonce):
        """Rank 0: stamp the header (read back by the others to prove they map the same file)."""
        h = self._header
        h[1], h[2], h[3], h[4] = self.world_size, self.slot_bytes, nonce, 0
        h[0] = _MAGIC

    def header_matches(self, nonce):
        """True when this mapping carries the header rank 0 wrote for this group."""
        h = self._header
        return (h[0], h[1], h[2], h[3]) == (_MAGIC, self.world_size, self.slot_bytes, nonce)

    # -- control blocks --------------------------------------------------------------------
    def counter(self, rank):
        """The phase counter of ``rank`` (a ctypes uint32 at a futex-able address)."""
        return ctypes.c_uint32.from_buffer(self._mm, _HEADER + rank * self.ctrl_bytes)

    def set_identity(self, rank, pid, start_time):
        """Publish the process of ``rank`` (checked by waiters for liveness)."""
        self._ctrl[rank][2] = start_time
        self._ctrl[rank][1] = pid

    def identity(self, rank):
        """``(pid, start time)`` of ``rank``; pid 0 until it is published."""
        return self._ctrl[rank][1], self._ctrl[rank][2]

    def set_fingerprint(self, rank, p, words):
        """Describe the collective ``rank`` starts in phase ``p`` (compared by its peers)."""
        base = 4 + (p % 2) * _FP_WORDS
        ctrl = self._ctrl[rank]
        for i, w in enumerate(words):
            ctrl[base + i] = w

    def fingerprint(self, rank, p, n):
        """The first ``n`` words of the fingerprint ``rank`` wrote for phase ``p``."""
        base = 4 + (p % 2) * _FP_WORDS
        return tuple(self._ctrl[rank][base:base + n])

    def set_meta(self, rank, p, values):
        """Publish up to world_size int64 ``values`` for phase ``p`` (e.g. message sizes)."""
        base = self._meta + (p % 2) * self.world_size
        ctrl = self._ctrl[rank]
        for i, v in enumerate(values):
            ctrl[base + i] = v

    def meta(self, rank, p):
        """The world_size values ``rank`` published with :meth:`set_meta` for phase ``p``."""
        base = self._meta + (p % 2) * self.world_size
        return self._ctrl[rank][base:base + self.world_size]

    def set_abort(self, rank, message):
        """Mark the group broken by ``rank``, with a reason its peers will quote."""
        text = message.encode("utf-8", "replace")[:_ABORT_TEXT - 1] + b"\0"
        start = _HEADER + rank * self.ctrl_bytes + self._text
        self._mm[start:start + len(text)] = text
        self._ctrl[rank][3] = 1  # the flag after the text

    def abort_message(self, rank):
        """The reason ``rank`` broke the group, or None."""
        if not self._ctrl[rank][3]:
            return None
        start = _HEADER + rank * self.ctrl_bytes + self._text
        return self._mm[start:start + _ABORT_TEXT].split(b"\0", 1)[0].decode("utf-8", "replace")

    # -- data ------------------------------------------------------------------------------
    def half(self, rank, p):
        """The uint8 tensor holding ``rank``'s data for phase ``p`` (half ``p % 2`` of its slot)."""
        return self._halves[rank][p % 2]

    # -- clean-up --------------------------------------------------------------------------
    def unlink(self):
        """Remove the file (the mapping stays valid); harmless when already removed."""
        _unlink(self.path)

    def close(self):
        """Unlink and unmap (the unmap waits for the garbage collector if views remain)."""
        self.unlink()
        self._halves = self._ctrl = self._header = None
        try:
            self._mm.close()
        except BufferError:  # a counter or tensor view is still referenced somewhere
            pass


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _store_wait(store, keys, timeout, what):
    """Wait for ``keys`` ({rank: key}); on timeout name the ranks that did not write theirs."""
    try:
        store.wait(list(keys.values()), timeout)
    except RuntimeError as err:  # DistStoreError (TCPStore) or RuntimeError (other stores)
        missing = [r for r, k in keys.items() if not store.check([k])]
        raise ShmBackendError(f"nbdist_shm: group set-up timed out after "
                              f"{timeout.total_seconds():g}s waiting for {what} from rank(s) "
                              f"{missing} (not started, crashed, or not calling "
                              "init_process_group/new_group)") from err


def default_slot_bytes(world_size, free):
    """The slot size when none is given: :data:`DEFAULT_SLOT_BYTES`, or less where ``free``
    bytes in :data:`SHM_DIR` are few (Docker's default /dev/shm is 64 MiB): a group's segment
    then takes at most half of them, the rest being left to other groups and to nbdist's tensor
    transfers; never under :data:`MIN_DEFAULT_SLOT_BYTES`."""
    fits = (free // 2 - _overhead(world_size)) // world_size // 8192 * 8192
    return max(MIN_DEFAULT_SLOT_BYTES, min(DEFAULT_SLOT_BYTES, fits))


def _overhead(world_size):
    return _align(_HEADER + world_size * 4096, 4096)


def open_segment(store, rank, world_size, timeout, slot_bytes=None):
    """Run the rendezvous described in the module docstring; return this rank's Segment."""
    if platform.machine() not in _MACHINES:
        raise ShmBackendError(
            f"nbdist_shm: this backend relies on x86-64 memory ordering and refuses to run on "
            f"{platform.machine()!r}; use backend='gloo' here")
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    store.set(f"{_KEY}/host/{rank}", json.dumps(host_identity()))
    if rank == 0:
        return _create(store, world_size, timeout, slot_bytes)
    _store_wait(store, {0: f"{_KEY}/id"}, timeout, "the segment name")
    reply = json.loads(store.get(f"{_KEY}/id"))
    if "error" in reply:
        raise ShmBackendError(reply["error"])
    path = os.path.join(SHM_DIR, reply["name"])
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as err:
        raise ShmBackendError(
            f"nbdist_shm: rank {rank} cannot open the group's segment {path}: the ranks do not "
            f"share {SHM_DIR} (different containers?) or rank 0 gave up") from err
    try:
        seg = Segment(path, fd, world_size, reply["slot_bytes"], create=False)
    finally:
        os.close(fd)
    if not seg.header_matches(reply["nonce"]):
        seg.close()
        raise ShmBackendError(f"nbdist_shm: rank {rank} mapped {path} but its header is not the "
                              "one rank 0 wrote: the ranks do not share shared memory")
    seg.cores = reply["cores"]
    seg.set_identity(rank, os.getpid(), process_start_time(os.getpid()))
    store.set(f"{_KEY}/attached/{rank}", "1")
    return seg


def _create(store, world_size, timeout, slot_bytes):
    keys = {r: f"{_KEY}/host/{r}" for r in range(world_size)}
    _store_wait(store, keys, timeout, "the host identity")
    hosts = [json.loads(v) for v in store.multi_get(list(keys.values()))]
    if any(h != hosts[0] for h in hosts):
        where = ", ".join(f"rank {r}: {h['host']} (boot {h['boot_id'][:8]})"
                          for r, h in enumerate(hosts))
        message = ("nbdist_shm: the ranks of a group must all run on one host (shared memory), "
                   f"but they run on {where}. Use backend='gloo' across hosts.")
        store.set(f"{_KEY}/id", json.dumps({"error": message}))
        raise ShmBackendError(message)
    free = shutil.disk_usage(SHM_DIR).free
    if slot_bytes is None:
        slot_bytes = default_slot_bytes(world_size, free)
    slot_bytes = _align(max(int(slot_bytes), 8192, 256 * world_size), 8192)
    need = _overhead(world_size) + world_size * slot_bytes
    if free < need:
        message = (f"nbdist_shm: {SHM_DIR} has {free / 2**20:.0f} MiB free but a group of "
                   f"{world_size} ranks needs {need / 2**20:.0f} MiB (slot_bytes="
                   f"{slot_bytes}). Free space there (in a container: a larger --shm-size) or "
                   "register the backend with smaller slot_bytes.")
        store.set(f"{_KEY}/id", json.dumps({"error": message}))
        raise ShmBackendError(message)
    name = f"nbdist-shm-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        seg = Segment(path, fd, world_size, slot_bytes, create=True)
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)
    try:
        nonce = secrets.randbits(62)
        seg.write_header(nonce)
        seg.set_identity(0, os.getpid(), process_start_time(os.getpid()))
        store.set(f"{_KEY}/id", json.dumps({"name": name, "slot_bytes": slot_bytes,
                                            "nonce": nonce, "cores": seg.cores}))
        attached = {r: f"{_KEY}/attached/{r}" for r in range(1, world_size)}
        if attached:
            _store_wait(store, attached, timeout, "the attachment")
    except BaseException:
        seg.close()
        raise
    seg.unlink()  # everyone has it mapped: nothing can be left in /dev/shm from now on
    for key in [*keys.values(), *attached.values(), f"{_KEY}/id"]:
        store.delete_key(key)
    return seg
