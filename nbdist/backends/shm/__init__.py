"""``nbdist_shm``: a torch.distributed backend for ranks that share one host.

**What a custom backend is.** ``torch.distributed`` does not move bytes itself: each process
group hands its collectives to a *backend* (gloo, NCCL, ...). Any library can add one:
``torch.distributed.Backend.register_backend(name, creator)`` makes ``name`` valid in
``init_process_group(name)`` and ``new_group(backend=name)``, and torch then calls
``creator(store, rank, world_size, timeout)`` once per group, with a c10d store private to
that group. In torch 2.13 the creator may return a Python subclass of
``torch.distributed.ProcessGroup`` whose ``allreduce``, ``broadcast``... methods take lists of
tensors and option structs and return a ``Work``; torch uses that object *as* the group, and
C++ callers (DDP's reducer, functional collectives) reach the Python methods through a
trampoline. That is all this package is::

    import torch.distributed as dist
    import nbdist.shm

    nbdist.shm.register()                     # in every process, before init
    dist.init_process_group("nbdist_shm", store=store, rank=rank, world_size=n)
    dist.all_reduce(t)                        # DDP, FSDP2, ZeRO... work unchanged

With nbdist: ``nbdist.register_backend("nbdist_shm", "nbdist.shm:create", devices=["cpu"])``
then ``nbdist.start(world_size=n, backend="nbdist_shm")``.

**How this one works.** At group creation the ranks meet through the store: they check
that they run on one host (same hostname and kernel boot id), rank 0 creates a file
``/dev/shm/nbdist-shm-<random id>`` (one per group, never shared), everyone maps it, and rank 0
deletes the name again, so nothing is left behind even if processes crash. Every rank owns
a control block and a data slot in it. A collective is a series of *phases*: each rank
copies its contribution into its slot, bumps its own phase counter, waits (spinning briefly,
then sleeping in a futex) until the ranks it reads from have bumped theirs, and reads their
slots with torch ops: an all_reduce of a large tensor is a copy in, a reduction of this
rank's 1/N share across all slots, a copy out -- memcpy speed, no sockets, no store traffic.
Large tensors move in chunks (4 MiB when every rank has a core; 16 MiB, fewer waits, when
ranks share cores: rank 0's count of the cores it may use decides, for every rank), so memory
stays bounded (``slot_bytes`` per rank and group, 32 MiB by
default -- less where ``/dev/shm`` is small, see :func:`create` -- and only touched pages
count). Every wait has a deadline
(the group timeout) and checks that the peers are alive, so a crashed rank gives its peers
an error within ~0.1 s instead of a hang; the first phase of every call compares what the
ranks called, so mismatched collectives fail with both calls named.
Details: :mod:`nbdist.shm.sync` (protocol), :mod:`nbdist.shm.segment` (layout, rendezvous),
:mod:`nbdist.shm.algorithms` (collectives).

**When it helps.** Several ranks on one machine with CPU tensors: gloo sends every byte
through TCP loopback, at a tenth of memory bandwidth, and pays milliseconds for small
messages when ranks outnumber cores. This backend runs large all_reduces several times
faster and small ones with less latency (see ``benchmarks/bench_shm.py``). It does not help
across hosts (it refuses them), with GPU tensors (use NCCL), or for point-to-point, gather
and scatter (not implemented: it raises, use a gloo group for those).
"""
from __future__ import annotations

import functools

import torch.distributed as dist

from .errors import ShmBackendError, ShmUnsupportedError
from .group import SUPPORTED_OPS, ShmProcessGroup
from .segment import DEFAULT_SLOT_BYTES

__all__ = ["BACKEND_NAME", "DEFAULT_SLOT_BYTES", "SUPPORTED_OPS", "ShmBackendError",
           "ShmProcessGroup", "ShmUnsupportedError", "create", "register"]

BACKEND_NAME = "nbdist_shm"
"""Default name under which :func:`register` registers the backend."""


def create(store, rank, world_size, timeout, *, name=BACKEND_NAME, slot_bytes=None):
    """The creator torch calls as ``create(store, rank, world_size, timeout)``, once per group.

    ``slot_bytes`` is the shared memory each rank gets in each group (only touched pages
    count); tensors larger than half of it move in chunks. By default 32 MiB, or less where
    ``/dev/shm`` is small (Docker's default is 64 MiB): then the group takes at most half of
    its free space, at least 1 MiB a rank.
    """
    return ShmProcessGroup(store, rank, world_size, timeout, name=name, slot_bytes=slot_bytes)


def register(name=BACKEND_NAME, *, slot_bytes=None):
    """Register the backend as ``name`` in this process (CPU tensors); idempotent. Returns ``name``.

    Registration is per process: call it in every process before ``init_process_group(name)``.
    Raises ``ValueError`` if ``name`` is already taken by another backend. torch cannot
    unregister a backend: a second call with another ``slot_bytes`` keeps the first one (use
    another name for other settings).
    """
    plugin = getattr(dist.Backend, "_plugins", {}).get(name.upper())
    creator = getattr(plugin, "creator_fn", None)
    if creator is create or getattr(creator, "func", None) is create:
        return name  # already registered with this module's creator
    if name.lower() in dist.Backend.backend_list:
        raise ValueError(f"backend name {name!r} is already taken by another backend")
    dist.Backend.register_backend(
        name, functools.partial(create, name=name, slot_bytes=slot_bytes), devices=["cpu"])
    return name
