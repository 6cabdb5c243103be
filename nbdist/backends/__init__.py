"""Backends: which torch.distributed backend a group uses, and the two nbdist ships.

Owns the resolution of ``"auto"`` and of names and mapping strings (:mod:`.resolve`, the table in
DESIGN.md), the registry of custom backends that every worker registers again, nbdist's
shared-memory backend ``nbdist_shm`` (:mod:`nbdist.backends.shm`, also importable as ``nbdist.shm``)
and the pure-Python store backend (:mod:`nbdist.backends.store`, also ``nbdist.store_backend``).

May import: :mod:`nbdist.wire`, :mod:`nbdist.errors`, torch. Never a group or anything above.
"""
from .resolve import (ENV_VAR, BackendChoice, CustomBackend, available_backends, backend_report,
                      register_backend, registered_backends, resolve_backend, resolve_device,
                      unregister_backend)

__all__ = ["ENV_VAR", "BackendChoice", "CustomBackend", "available_backends", "backend_report",
           "register_backend", "registered_backends", "resolve_backend", "resolve_device",
           "unregister_backend"]
