"""The exceptions the ``nbdist_shm`` backend raises.

Both derive from ``RuntimeError``, which is what torch's own backends raise, so code that
catches collective failures keeps working.
"""

__all__ = ["ShmBackendError", "ShmUnsupportedError"]


class ShmBackendError(RuntimeError):
    """A collective or the group set-up failed: a peer died or timed out, the ranks called
    mismatched collectives, the ranks are not on one host, or shared memory ran out.

    After an error raised by a collective, or a collective left by any other exception (a
    KeyboardInterrupt), the group is unusable on every rank (the failing rank marks it broken
    in shared memory, so its peers fail fast too): destroy it with
    ``torch.distributed.destroy_process_group`` and create a new one.
    """


class ShmUnsupportedError(ShmBackendError, NotImplementedError):
    """The backend does not implement this operation, reduce op or dtype.

    Raised before any data moves, on every rank alike, so the group stays usable. The
    backend never falls back to another backend behind your back: the message says what is
    supported and how to use a gloo group for the rest.
    """
