"""A pure-Python ``torch.distributed`` backend that moves tensors through the c10d Store.

nbdist's "bring your own backend" teaching example: slow (every byte goes through the
rendezvous store), but short, compiler-free, and it shows the whole contract a custom
backend has with torch 2.13::

    from nbdist.backends import store
    store.register()                          # in every process, before init
    dist.init_process_group("nbstore", store=store, rank=rank, world_size=n, timeout=t)

How it works. ``init_process_group`` and ``new_group`` call :func:`create` with a
``PrefixStore`` private to the group. Each collective call takes the next number of a
per-group sequence counter, so all ranks derive the same store keys for the same call.
A rank *writes* what it contributes under ``<seq>/<op>/<src>><dst>`` (``dst`` is ``all``
for a message every rank reads), *waits* for the keys it needs (with the group timeout,
so a missing peer gives an error instead of a hang), *reads* them and computes its result
locally. Reductions combine contributions in rank order, so all ranks get identical bits.

Store hygiene. The TCPStore server rejects values over 8 MiB, so a message is split into
1 MiB chunks ``<key>/0 .. <key>/n-1``. Chunk 0 is written last and starts with the message
length: once it exists, the whole message is there. A message for one rank is deleted by
that rank after reading it; a message for everyone is deleted by the last rank to check
out of the call (a ``done`` counter bumped with ``store.add``). So the store does not grow.
"""

import functools

import torch.distributed as dist

from .group import (BACKEND_NAME, CHUNK_BYTES, SHUTDOWN_WAIT, StoreProcessGroup,  # noqa: F401
                    _completed_work)

__all__ = ["BACKEND_NAME", "CHUNK_BYTES", "SHUTDOWN_WAIT", "StoreProcessGroup", "create",
           "register"]


def create(store, rank, world_size, timeout, name=BACKEND_NAME):
    """The creator torch calls as ``create(store, rank, world_size, timeout)``, once per group."""
    return StoreProcessGroup(store, rank, world_size, timeout, name)


def register(name=BACKEND_NAME):
    """Register the backend as ``name`` in this process; a no-op if already done. Returns ``name``.

    Registration is per process: run it in every worker before ``init_process_group(name)``.
    """
    plugin = getattr(dist.Backend, "_plugins", {}).get(name.upper())
    creator = getattr(plugin, "creator_fn", None)
    if creator is create or getattr(creator, "func", None) is create:
        return name  # already registered, by us or with this module's create
    if name.lower() in dist.Backend.backend_list:
        raise ValueError(f"backend name {name!r} is already taken by another backend")
    dist.Backend.register_backend(name, functools.partial(create, name=name), devices=["cpu"])
    return name
