"""What a call brings in, before any data moves: reduce ops, dtypes, fingerprints, the guard.

The tables here decide what the backend accepts (a refused call raises on every rank alike,
so the group stays usable), and how a call is described in the fingerprint the ranks compare
in its first phase (six int64 words: op, dtype, bytes, root + 1, reduce op + 1, bytes this
rank sends), and in the error message when they differ.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

__all__ = ["FP_WORDS", "REDUCTIONS", "SUPPORTED_OPS", "CallGuard", "combiner", "describe",
           "done", "fingerprint"]

SUPPORTED_OPS = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
                 "all_gather_coalesced", "all_gather_into_tensor", "reduce_scatter",
                 "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier")
"""The torch.distributed calls this backend implements (plus their coalesced forms)."""

_R = dist.ReduceOp
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_COMPLEX = (torch.complex64, torch.complex128)
# (name, ReduceOp, torch function, dtypes it accepts); opts.reduceOp is a ReduceOp
# *instance*, which is not hashable: look it up with ==.
REDUCTIONS = [
    ("SUM", _R.SUM, torch.add, _FLOATS + _INTS + _COMPLEX),
    ("AVG", _R.AVG, torch.add, _FLOATS + _COMPLEX),
    ("PRODUCT", _R.PRODUCT, torch.mul, _FLOATS + _INTS + _COMPLEX),
    ("MIN", _R.MIN, torch.minimum, _FLOATS + _INTS + (torch.bool,)),
    ("MAX", _R.MAX, torch.maximum, _FLOATS + _INTS + (torch.bool,)),
    ("BAND", _R.BAND, torch.bitwise_and, _INTS + (torch.bool,)),
    ("BOR", _R.BOR, torch.bitwise_or, _INTS + (torch.bool,)),
    ("BXOR", _R.BXOR, torch.bitwise_xor, _INTS + (torch.bool,)),
]
"""Every reduce op the backend implements: (name, ReduceOp, torch function, dtypes)."""
_OPS = ("?",) + SUPPORTED_OPS
_DTYPES = ("?",) + tuple(d for d in vars(torch).values() if isinstance(d, torch.dtype))
_DTYPE_CODE = {}
for _i, _d in enumerate(_DTYPES[1:], 1):
    _DTYPE_CODE.setdefault(_d, _i)  # aliases (torch.float, torch.float32) share a code
FP_WORDS = 6
"""Number of int64 words in a fingerprint."""
_OP_CODE = {op: i for i, op in enumerate(_OPS)}


def done(result):
    """A completed ``Work`` whose future holds ``result`` (every call here is synchronous)."""
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def fingerprint(op, dtype=None, nbytes=0, root=None, red=0, sends=0):
    """The words describing a call (``red``: 1 + index in REDUCTIONS, 0 for none)."""
    return (_OP_CODE.get(op, 0), _DTYPE_CODE.get(dtype, 0), nbytes,
            0 if root is None else root + 1, red, sends)


def describe(words):
    """``all_reduce(float32, 16 bytes, SUM)``: a fingerprint as text."""
    op, dtype, nbytes, root, red, sends = words
    text = f"{_OPS[op] if 0 <= op < len(_OPS) else '?'}("
    text += ", ".join(part for part in (
        str(_DTYPES[dtype]).replace("torch.", "") if 0 < dtype < len(_DTYPES) else "",
        f"{nbytes} bytes" if nbytes else "",
        f"root {root - 1}" if root else "",
        REDUCTIONS[red - 1][0] if 0 < red <= len(REDUCTIONS) else "",
        f"sending {sends} bytes" if sends else "") if part)
    return text + ")"


def combiner(name, fn, world_size, dtype):
    """``combine(out, parts, own=None)``: ``out = fn(...fn(parts[0], parts[1])..., parts[-1])``
    in rank order (bit-identical on every rank), divided by the world size for AVG.

    ``own``: the index of the part whose values ``out`` already holds. With two parts and an
    op that is exactly commutative on ``dtype`` (a + b == b + a bit for bit; not MIN/MAX on
    floats: signed zeros and NaNs), ``out`` is then combined with the other part in place:
    one buffer less to stream through the cache (measured: 20% faster).
    """
    inplace = getattr(torch.Tensor, fn.__name__ + "_", None)
    if inplace is None:  # torch.minimum / maximum have no in-place method
        def inplace(out, part):
            fn(out, part, out=out)
    exact = name in ("SUM", "AVG", "PRODUCT") or not (dtype.is_floating_point or dtype.is_complex)

    def combine(out, parts, own=None):
        if len(parts) == 1:
            out.copy_(parts[0])
        elif own is not None and exact and len(parts) == 2:
            inplace(out, parts[1 - own])
        else:
            fn(parts[0], parts[1], out=out)
            for part in parts[2:]:
                inplace(out, part)
        if name == "AVG":
            out.div_(world_size)
    return combine


class CallGuard:
    """Serialises the calls on a group and caps torch's intra-op threads during them; a call
    left by an exception (a KeyboardInterrupt mid-collective) breaks the group for every rank.

    With more torch threads than cores per rank, OpenMP workers spinning after each copy take
    the cores from the peers being waited for (measured: 100x slower). The thread count is
    put back when the call returns. (A class, not a generator: it runs on every call.)
    """

    def __init__(self, pg, threads):
        """Guard the calls of ``pg``; ``threads``: the intra-op thread cap."""
        self.pg, self.threads, self.op, self.saved = pg, threads, "", 0
        self.lock = threading.Lock()

    def __enter__(self):
        self.lock.acquire()
        try:
            if self.pg._closed:
                raise RuntimeError(f"{self.pg._where(self.op)}: the group has been shut down")
            self.pg._sync.check_usable(self.op)
        except BaseException:
            self.lock.release()
            raise
        self.saved = torch.get_num_threads()
        if self.saved > self.threads:
            torch.set_num_threads(self.threads)

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is not None and self.pg._sync.broken is None:
                # Left in the middle of a call (KeyboardInterrupt...): the ranks are no longer
                # in step, so the group must not be used again, here or by the peers.
                self.pg._sync.abandon(f"{self.pg._where(self.op)} was interrupted by "
                                      f"{exc_type.__name__} in the middle of the call")
        finally:
            if self.saved > self.threads:
                torch.set_num_threads(self.saved)
            self.lock.release()
