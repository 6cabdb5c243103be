"""``ShmProcessGroup``: the ``torch.distributed.ProcessGroup`` of the ``nbdist_shm`` backend.

This module adapts torch's calling conventions (lists of tensors, option structs, old and
new method names) to :mod:`nbdist.shm.algorithms`, checks arguments before any data moves
(so a refused call fails on every rank alike and leaves the group usable), and handles
non-contiguous tensors by working on a contiguous copy.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .algorithms import Algorithms
from .calls import (FP_WORDS, REDUCTIONS, SUPPORTED_OPS, CallGuard, combiner, describe, done,
                    fingerprint)
from .errors import ShmUnsupportedError
from .segment import open_segment
from .sync import Sync, usable_cores

__all__ = ["ShmProcessGroup"]

_R = dist.ReduceOp


class ShmProcessGroup(dist.ProcessGroup):
    """A process group whose ranks share one host and exchange tensors through shared memory.

    Created by torch through :func:`nbdist.shm.create`, once per group (the default group and
    every ``new_group``). Dense CPU tensors only; every call is synchronous and returns a
    completed ``Work`` (``async_op=True`` works: the work is done when it is returned).
    """

    def __init__(self, store, rank, world_size, timeout, name="nbdist_shm",
                 slot_bytes=None):
        """Join the group through its ``store`` (a PrefixStore private to the group)."""
        super().__init__(rank, world_size)
        self._rank, self._size = rank, world_size
        self._name, self._group_name = name, ""
        if not isinstance(timeout, timedelta):
            timeout = timedelta(seconds=float(timeout))
        self._seg = open_segment(store, rank, world_size, timeout, slot_bytes)
        self._sync = Sync(self._seg, rank, world_size, timeout.total_seconds(), self._where)
        self._alg = Algorithms(self._seg, self._sync, self._mismatch)
        self._closed = False
        self._combiners = {}
        self._calling = CallGuard(self, max(1, usable_cores() // world_size))

    def _call(self, op):
        """Context for one call: see :class:`~nbdist.shm.calls.CallGuard`."""
        self._calling.op = op
        return self._calling

    # -- identity ----------------------------------------------------------------------------
    def getBackendName(self):
        """Name of this backend (what ``pg.name()`` returns)."""
        return self._name

    def setGroupName(self, name):
        """Called by torch with the group's name (functional collectives look groups up by it)."""
        self._group_name = name

    def getGroupName(self):
        """The name torch gave this group."""
        return self._group_name

    def _where(self, op):
        return f"{self._name}: {op} on rank {self._rank} of group {self._group_name or '?'!r}"

    # -- checks ------------------------------------------------------------------------------
    def _unsupported(self, what):
        raise ShmUnsupportedError(
            f"{self._name} backend does not support {what}. Supported: "
            f"{', '.join(SUPPORTED_OPS)}; reduce ops SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR. "
            "For anything else use a gloo group, e.g. dist.new_group(backend='gloo').")

    def _reduction(self, op, red, dtype):
        """(code, combine(out, parts)) for ReduceOp ``red`` on ``dtype``, or raise."""
        for code, (name, candidate, fn, dtypes) in enumerate(REDUCTIONS, 1):
            if red == candidate:
                break
        else:
            return self._unsupported(f"{op} with reduce op {red}")
        found = self._combiners.get((code, dtype))
        if found is not None:
            return found
        if dtype not in dtypes:
            self._unsupported(f"{op} with {name} on {dtype} tensors")
        found = self._combiners[(code, dtype)] = (code, combiner(name, fn, self._size, dtype))
        return found

    def _tensor(self, op, t):
        if t.device.type != "cpu" or t.layout != torch.strided:
            self._unsupported(f"{op} on a {t.layout} tensor on {t.device} (dense CPU tensors only)")
        return t.detach() if t.requires_grad else t

    def _flat(self, op, t):
        """(flat contiguous 1-D tensor, tensor to copy the result back into or None)."""
        t = self._tensor(op, t)
        if t.is_contiguous() and not t.is_conj() and not t.is_neg():
            return t.view(-1), None
        return t.resolve_conj().resolve_neg().contiguous().view(-1), t

    def _mismatch(self, op, p, words, ranks, expect=None):
        for j in ranks:
            if j == self._rank:
                continue
            theirs = self._seg.fingerprint(j, p, FP_WORDS)
            want = expect(j) if expect else words
            if theirs != tuple(want):
                self._sync.fail(
                    f"{self._where(op)}: collective mismatch: this rank called "
                    f"{describe(words)} but rank {j} called {describe(theirs)}. "
                    "Every rank must call the same collectives in the same order, with "
                    "matching shapes, dtypes and arguments.")

    # -- reductions --------------------------------------------------------------------------
    def _all_reduce(self, op, tensor, red, root=None):
        flat, back = self._flat(op, tensor)
        code, combine = self._reduction(op, red, flat.dtype)
        fp = fingerprint(op, flat.dtype, flat.numel() * flat.element_size(), root, code)
        with self._call(op):
            self._alg.all_reduce(op, flat, combine, fp, root)
        if back is not None and (root is None or root == self._rank):
            back.copy_(flat.view(back.shape))

    def allreduce(self, tensors, opts=None):
        """``dist.all_reduce``: reduce each tensor element-wise across ranks, in place."""
        red = opts.reduceOp if opts is not None else _R.SUM
        for t in tensors:
            self._all_reduce("all_reduce", t, red)
        return done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        """``dist.all_reduce_coalesced``: several all_reduces with one reduce op."""
        red = opts.reduceOp if opts is not None else _R.SUM
        for t in tensors:
            self._all_reduce("all_reduce_coalesced", t, red)
        return done(tensors)

    def reduce(self, tensors, opts):
        """``dist.reduce``: reduce across ranks into rank ``opts.rootRank``'s tensor."""
        for t in tensors:
            self._all_reduce("reduce", t, opts.reduceOp, opts.rootRank)
        return done(tensors)

    def reduce_scatter_single(self, output, input, opts):
        """``dist.reduce_scatter_tensor``: reduce ``input`` (world size x ``output``) across
        ranks; rank r keeps block r."""
        op = "reduce_scatter_tensor"
        out, back = self._flat(op, output)
        inp = self._flat(op, input)[0]
        if inp.numel() != out.numel() * self._size or inp.dtype != out.dtype:
            raise ValueError(f"{self._where(op)}: input must have world size ({self._size}) "
                             f"times the elements of output and the same dtype; got input "
                             f"{inp.numel()} x {inp.dtype}, output {out.numel()} x {out.dtype}")
        code, combine = self._reduction(op, opts.reduceOp, out.dtype)
        fp = fingerprint(op, out.dtype, inp.numel() * inp.element_size(), None, code)
        with self._call(op):
            self._alg.reduce_scatter(op, out, inp, combine, fp)
        if back is not None:
            back.copy_(out.view(back.shape))
        return done([output])

    _reduce_scatter_base = reduce_scatter_single  # the older name of the same op

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        """Several ``reduce_scatter_tensor`` in one call (reachable from C++)."""
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        """``dist.reduce_scatter`` (list form): rank r gets the reduction of ``inputs[r]``."""
        for output, inputs in zip(output_tensors, input_tensors):
            if len(inputs) != self._size:
                raise ValueError(f"{self._where('reduce_scatter')}: needs a list of "
                                 f"{self._size} input tensors, got {len(inputs)}")
            stacked = torch.stack([self._tensor("reduce_scatter", t).reshape(output.shape)
                                   for t in inputs])
            self.reduce_scatter_single(output, stacked, opts)
        return done(output_tensors)

    # -- data movement -------------------------------------------------------------------------
    def broadcast(self, tensors, opts):
        """``dist.broadcast``: copy rank ``opts.rootRank``'s tensors into every rank's."""
        op, root = "broadcast", opts.rootRank
        for t in tensors:
            flat, back = self._flat(op, t)
            data = flat.view(torch.uint8)
            fp = fingerprint(op, flat.dtype, data.numel(), root)
            with self._call(op):
                self._alg.broadcast(op, data, root, fp)
            if back is not None and self._rank != root:
                back.copy_(flat.view(back.shape))
        return done(tensors)

    def _all_gather(self, op, input, outputs):
        inp = self._flat(op, input)[0].view(torch.uint8)
        flats = [self._flat(op, o) for o in outputs]
        outs = [f.view(torch.uint8) for f, _ in flats]
        if any(o.dtype != input.dtype for o in outputs):
            raise ValueError(f"{self._where(op)}: output and input dtypes differ")
        if outs[self._rank].numel() != inp.numel():
            raise ValueError(f"{self._where(op)}: this rank's output has "
                             f"{outs[self._rank].numel()} bytes but its input has {inp.numel()}")
        total = sum(o.numel() for o in outs)
        fp = fingerprint(op, input.dtype, total, sends=inp.numel())
        with self._call(op):
            self._alg.all_gather(op, inp, outs, fp,
                                 lambda j: fp[:5] + (outs[j].numel(),))
        for (flat, back) in flats:
            if back is not None:
                back.copy_(flat.view(back.shape))

    def allgather(self, output_tensors, input_tensors, opts=None):
        """``dist.all_gather``: ``output_tensors[i][r]`` receives rank r's ``input_tensors[i]``
        (sizes may differ by rank)."""
        for outputs, input in zip(output_tensors, input_tensors):
            if len(outputs) != self._size:
                raise ValueError(f"{self._where('all_gather')}: needs a list of "
                                 f"{self._size} output tensors, got {len(outputs)}")
            self._all_gather("all_gather", input, outputs)
        return done(output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``dist.all_gather_coalesced``: ``output_lists[r][i]`` receives rank r's
        ``input_list[i]``."""
        for i, input in enumerate(input_list):
            self._all_gather("all_gather_coalesced", input, [out[i] for out in output_lists])
        return done(output_lists)

    def all_gather_single(self, output, input, opts=None):
        """``dist.all_gather_into_tensor``: every rank's ``input``, in rank order, into
        ``output`` (world size times the elements of ``input``)."""
        op = "all_gather_into_tensor"
        out = self._tensor(op, output)
        if out.numel() != input.numel() * self._size:
            raise ValueError(f"{self._where(op)}: output must have world size ({self._size}) "
                             f"times the elements of input; got output {out.numel()}, input "
                             f"{input.numel()}")
        flat, back = self._flat(op, out)
        k = input.numel()
        self._all_gather(op, input, [flat[j * k:(j + 1) * k] for j in range(self._size)])
        if back is not None:
            back.copy_(flat.view(back.shape))
        return done([output])

    _allgather_base = all_gather_single  # the older name of the same op

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """Several ``all_gather_into_tensor`` in one call (reachable from C++)."""
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts)
        return done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _all_to_all(self, op, outputs, inputs):
        sends = [self._flat(op, t)[0].view(torch.uint8) for t in inputs]
        flats = [self._flat(op, t) for t in outputs]
        recvs = [f.view(torch.uint8) for f, _ in flats]
        dtype = inputs[0].dtype if len(inputs) else None
        with self._call(op):
            self._alg.all_to_all(op, sends, recvs, fingerprint(op, dtype))
        for flat, back in flats:
            if back is not None:
                back.copy_(flat.view(back.shape))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """``dist.all_to_all_single``: split ``input`` along dim 0 (evenly, or by
        ``input_split_sizes``), send piece d to rank d; ``output`` receives the pieces in
        rank order (``output_split_sizes``)."""
        op, n = "all_to_all_single", self._size
        for name, t, splits in (("input", input, input_split_sizes),
                                ("output", output, output_split_sizes)):
            rows = t.shape[0] if t.dim() else 1
            if (len(splits) != n or sum(splits) != rows) if splits else rows % n:
                shape = f"of sizes {list(splits)}" if splits else "of equal size"
                raise ValueError(f"{self._where(op)}: cannot split the {rows} rows of {name} "
                                 f"into {n} pieces {shape}")
        outs = output.split(list(output_split_sizes) or output.shape[0] // n)
        ins = input.split(list(input_split_sizes) or input.shape[0] // n)
        self._all_to_all(op, list(outs), list(ins))
        return done([output])

    alltoall_base = all_to_all_single  # the older name of the same op

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """``dist.all_to_all`` (list form): ``input_tensors[d]`` goes to rank d."""
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ValueError(f"{self._where('all_to_all')}: needs {self._size} input and "
                             "output tensors")
        self._all_to_all("all_to_all", list(output_tensors), list(input_tensors))
        return done(output_tensors)

    def barrier(self, opts=None):
        """``dist.barrier``: return once every rank of the group has entered it."""
        with self._call("barrier"):
            self._alg.barrier("barrier", fingerprint("barrier"))
        return done([])

    # -- refused ------------------------------------------------------------------------------
    def gather(self, output_tensors, input_tensors, opts=None):
        """Not supported (raises :class:`ShmUnsupportedError`)."""
        self._unsupported("gather")

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Not supported (raises :class:`ShmUnsupportedError`)."""
        self._unsupported("scatter")

    def send(self, tensors, dstRank, tag):
        """Not supported (raises :class:`ShmUnsupportedError`)."""
        self._unsupported("send (point-to-point)")

    def recv(self, tensors, srcRank, tag):
        """Not supported (raises :class:`ShmUnsupportedError`)."""
        self._unsupported("recv (point-to-point)")

    def recv_anysource(self, tensors, tag):
        """Not supported (raises :class:`ShmUnsupportedError`)."""
        self._unsupported("recv (point-to-point)")

    # -- end -----------------------------------------------------------------------------------
    def shutdown(self):
        """Release the shared memory (``destroy_process_group`` calls this). No waiting: peers
        keep their own mappings, and the memory goes away with the last one."""
        if not self._closed:
            self._closed = True
            self._alg.close()
            self._seg.close()
