"""The store backend's process group: every collective written to and read from the c10d Store."""

import ctypes
import functools
import math
import struct
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

__all__ = ["BACKEND_NAME", "CHUNK_BYTES", "SHUTDOWN_WAIT", "StoreProcessGroup"]

BACKEND_NAME = "nbstore"
"""Default name under which :func:`register` registers the backend."""

CHUNK_BYTES = 1024 * 1024
"""Largest store value written (plus an 8-byte header). The TCPStore server rejects values
over 8 MiB, and values of 4 MiB cost it about twice as much per byte as 1 MiB ones."""

SHUTDOWN_WAIT = timedelta(seconds=10)
"""Longest time ``shutdown`` waits for the other ranks (capped by the group timeout)."""

_HEADER = struct.Struct("<q")  # message length in bytes, in front of chunk 0
_ALL = "all"  # the destination of a message that every rank reads
_R = dist.ReduceOp
# opts.reduceOp is a ReduceOp *instance*, which is not hashable: no dict, compare with ==.
# AVG is handled apart (SUM, then divide).
_COMBINERS = [(_R.SUM, torch.add), (_R.PRODUCT, torch.mul), (_R.MIN, torch.minimum),
              (_R.MAX, torch.maximum), (_R.BAND, torch.bitwise_and),
              (_R.BOR, torch.bitwise_or), (_R.BXOR, torch.bitwise_xor)]


def _as_bytes(tensors):
    """Raw bytes of a list of dense CPU tensors, concatenated in order."""
    parts = []
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise RuntimeError(f"{BACKEND_NAME} backend: only dense CPU tensors are supported, "
                               f"got a {t.layout} tensor on {t.device}")
        t = t.detach().resolve_conj().resolve_neg().contiguous()
        parts.append(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size()))
    return b"".join(parts)


def _from_bytes(data, like):
    """Inverse of :func:`_as_bytes`: new tensors with the shapes and dtypes of ``like``."""
    out, offset = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        if n == 0:  # torch.frombuffer refuses an empty buffer
            out.append(torch.empty(t.shape, dtype=t.dtype))
        else:  # a bytearray copy, because frombuffer wants a writable buffer
            buf = bytearray(data[offset:offset + n])
            out.append(torch.frombuffer(buf, dtype=t.dtype).view(t.shape))
        offset += n
    return out


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def _chunk_count(size):
    return max(1, math.ceil(size / CHUNK_BYTES))


def _completed_work(result):
    """A finished ``Work`` whose future holds ``result`` (all our ops are synchronous)."""
    fut = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class StoreProcessGroup(dist.ProcessGroup):
    """A ``ProcessGroup`` whose collectives exchange tensor bytes through a c10d ``Store``.

    torch uses a ``ProcessGroup`` returned by a backend creator *as* the group. Python
    callers (``dist.all_reduce``...) find these methods directly; calls made in C++ (DDP,
    functional collectives) reach them through the pybind trampoline, which forwards only
    allreduce(_coalesced), allgather, broadcast, barrier, reduce_scatter, all_to_all_single,
    the ``*_single_coalesced`` ops, send and recv. Dense CPU tensors only; every op is
    synchronous and returns a completed ``Work``. ``rank()``/``size()`` come from the base.
    """

    def __init__(self, store, rank, world_size, timeout, name=BACKEND_NAME):
        """Use ``store`` (the group's PrefixStore) as group rank ``rank`` of ``world_size``."""
        super().__init__(rank, world_size)
        self._store, self._name, self._group_name = store, name, ""
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
        self._seq = 0  # collective calls so far: the same on every rank
        self._p2p = {}  # (direction, src, dst, tag) -> point-to-point messages so far
        self._closed = False

    def getBackendName(self):
        """Name of this backend (what ``pg.name()`` returns)."""
        return self._name

    def setGroupName(self, name):
        """Called by torch with the group's name (functional collectives look groups up by it)."""
        self._group_name = name

    def getGroupName(self):
        """The name torch gave this group; without it: 'ProcessGroup name not set'."""
        return self._group_name

    # -- the protocol ------------------------------------------------------------------
    def _put(self, key, data):
        """Write one message in chunks, chunk 0 last. Returns the chunk count."""
        n = _chunk_count(len(data))
        for i in reversed(range(n)):
            chunk = data[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]
            self._store.set(f"{key}/{i}", _HEADER.pack(len(data)) + chunk if i == 0 else chunk)
        return n

    def _fetch(self, op, keys, sizes):
        """Wait for and read messages ``keys`` ({src: key}) of expected ``sizes`` ({src: bytes}).

        Returns ({src: bytes}, {src: chunk count}). A timeout or a size mismatch raises a
        RuntimeError that says what went wrong and which ranks are involved.
        """
        if not keys:
            return {}, {}
        firsts = [f"{k}/0" for k in keys.values()]
        try:
            self._store.wait(firsts, self._timeout)
        except RuntimeError as err:  # DistStoreError (TCPStore), RuntimeError (FileStore)
            missing = [s for s, k in keys.items() if not self._store.check([f"{k}/0"])]
            raise RuntimeError(
                f"{self._name} backend: {op} on rank {self.rank()} of group {self._group_name!r} "
                f"timed out after {self._timeout.total_seconds():g}s waiting for group rank(s) "
                f"{missing}") from err
        datas, counts = {}, {}
        for (src, key), first in zip(keys.items(), self._store.multi_get(firsts)):
            size = _HEADER.unpack_from(first)[0]
            if size != sizes[src]:
                raise RuntimeError(
                    f"{self._name} backend: {op} mismatch: group rank {src} sent {size} bytes, "
                    f"rank {self.rank()} expected {sizes[src]}. Every rank must call the same "
                    "collectives in the same order, with matching shapes and dtypes.")
            n = counts[src] = _chunk_count(size)
            rest = [self._store.get(f"{key}/{i}") for i in range(1, n)]
            datas[src] = first[_HEADER.size:] + b"".join(rest)
        return datas, counts

    def _delete(self, key, chunks):
        for i in range(chunks):
            self._store.delete_key(f"{key}/{i}")

    def _exchange(self, op, to_all, send, recv_like):
        """One round of a collective; every op below is built on this.

        ``send`` maps a destination rank (or ``_ALL``) to the tensors this rank sends;
        ``recv_like`` maps each source rank to tensors shaped like what this rank receives.
        ``to_all``: messages are read by every rank (then each rank reads every other
        sender), else each message has one reader. Returns {src: [tensors]}.
        """
        seq, me = self._seq, self.rank()
        self._seq += 1

        def key(src, dst):
            return f"{seq}/{op}/{src}>{_ALL if to_all else dst}"

        written = {key(me, dst): self._put(key(me, dst), _as_bytes(ts)) for dst, ts in send.items()}
        keys = {src: key(src, me) for src in recv_like}
        datas, counts = self._fetch(op, keys, {s: _nbytes(ts) for s, ts in recv_like.items()})
        if not to_all:  # the only reader of a message deletes it
            for src, k in keys.items():
                self._delete(k, counts[src])
        elif self._store.add(f"{seq}/done", 1) == self.size():
            # Last rank to check out: all reads are over. This rank wrote or read every
            # message of the round, so it knows every key (and chunk count) to delete.
            for k, n in list(written.items()) + [(keys[s], counts[s]) for s in keys]:
                self._delete(k, n)
            self._store.delete_key(f"{seq}/done")
        return {src: _from_bytes(datas[src], like) for src, like in recv_like.items()}

    def _combiner(self, op, red, tensors):
        """Function reducing a rank-ordered list of tensors with ReduceOp ``red``.

        Called before any communication, so an unsupported op fails on every rank alike.
        """
        if red == _R.AVG:
            if not all(t.is_floating_point() or t.is_complex() for t in tensors):
                raise RuntimeError(f"{self._name} backend: {op} with AVG needs floating-point "
                                   "or complex tensors")
            return lambda parts: functools.reduce(torch.add, parts) / len(parts)
        for candidate, fn in _COMBINERS:
            if red == candidate:
                return lambda parts: functools.reduce(fn, parts)
        raise NotImplementedError(f"{self._name} backend: {op} does not support {red}")

    def _others(self):
        return [r for r in range(self.size()) if r != self.rank()]

    def _reduce_into(self, outputs, combine, got):
        """outputs[i] = combine(rank 0's got[0][i], rank 1's got[1][i], ...)."""
        for i, out in enumerate(outputs):
            out.copy_(combine([got[s][i] for s in range(self.size())]))

    # -- collectives -------------------------------------------------------------------
    def allreduce(self, tensors, opts):
        """Reduce ``tensors`` element-wise across ranks, in place (SUM, AVG, MIN, ...)."""
        combine = self._combiner("allreduce", opts.reduceOp, tensors)
        others = dict.fromkeys(self._others(), tensors)  # everyone sends a tensors-like message
        got = self._exchange("allreduce", True, {_ALL: tensors}, others)
        self._reduce_into(tensors, combine, {**got, self.rank(): tensors})
        return _completed_work(tensors)

    allreduce_coalesced = allreduce  # a list of tensors: same code

    def reduce(self, tensors, opts):
        """Reduce ``tensors`` across ranks into rank ``opts.rootRank``'s ``tensors``."""
        combine = self._combiner("reduce", opts.reduceOp, tensors)
        root, me = opts.rootRank, self.rank()
        got = self._exchange("reduce", False, {} if me == root else {root: tensors},
                             dict.fromkeys(self._others(), tensors) if me == root else {})
        if me == root:
            self._reduce_into(tensors, combine, {**got, me: tensors})
        return _completed_work(tensors)

    def broadcast(self, tensors, opts):
        """Copy rank ``opts.rootRank``'s ``tensors`` into every rank's ``tensors``."""
        root, me = opts.rootRank, self.rank()
        got = self._exchange("broadcast", True, {_ALL: tensors} if me == root else {},
                             {} if me == root else {root: tensors})
        for t, value in zip(tensors, got.get(root, [])):
            t.copy_(value)
        return _completed_work(tensors)

    def allgather(self, output_tensors, input_tensors, opts):
        """``output_tensors[i][r]`` receives rank r's ``input_tensors[i]`` (sizes may differ)."""
        like = {s: [outs[s] for outs in output_tensors] for s in self._others()}
        got = self._exchange("allgather", True, {_ALL: input_tensors}, like)
        got[self.rank()] = input_tensors
        for i, outs in enumerate(output_tensors):
            for s, out in enumerate(outs):
                out.copy_(got[s][i])
        return _completed_work(output_tensors)

    def all_gather_single(self, output, input, opts):
        """Concatenate every rank's ``input``, in rank order, into the tensor ``output``."""
        got = self._exchange("all_gather_single", True, {_ALL: [input]},
                             dict.fromkeys(self._others(), [input]))
        got[self.rank()] = [input]
        flat = torch.cat([got[s][0].reshape(-1) for s in range(self.size())])
        output.copy_(flat.view(output.shape))
        return _completed_work([output])

    _allgather_base = all_gather_single  # the older name of the same op

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        """Several ``all_gather_single`` in one call (reachable from C++, unlike the single one)."""
        for output, input in zip(outputs, inputs):
            self.all_gather_single(output, input, opts)
        return _completed_work(outputs)

    def allgather_coalesced(self, output_lists, input_list, opts):
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``."""
        self.allgather([list(col) for col in zip(*output_lists)], input_list, opts)
        return _completed_work(output_lists)

    def gather(self, output_tensors, input_tensors, opts):
        """Rank ``opts.rootRank`` receives rank r's tensor in ``output_tensors[0][r]``."""
        root, me = opts.rootRank, self.rank()
        like = {s: [output_tensors[0][s]] for s in self._others()} if me == root else {}
        got = self._exchange("gather", False, {} if me == root else {root: input_tensors}, like)
        if me == root:
            for s, out in enumerate(output_tensors[0]):
                out.copy_(input_tensors[0] if s == me else got[s][0])
        return _completed_work(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts):
        """Rank r receives ``input_tensors[0][r]`` of rank ``opts.rootRank``."""
        root, me = opts.rootRank, self.rank()
        send = {d: [input_tensors[0][d]] for d in self._others()} if me == root else {}
        got = self._exchange("scatter", False, send, {} if me == root else {root: output_tensors})
        output_tensors[0].copy_(input_tensors[0][me] if me == root else got[root][0])
        return _completed_work(output_tensors)

    def _reduce_scatter(self, op, outputs, pieces, red):
        """Rank d gets the reduction of every rank's ``pieces[d]`` (a list like ``outputs``)."""
        combine = self._combiner(op, red, outputs)
        got = self._exchange(op, False, {d: pieces[d] for d in self._others()},
                             dict.fromkeys(self._others(), outputs))
        self._reduce_into(outputs, combine, {**got, self.rank(): pieces[self.rank()]})

    def reduce_scatter_single(self, output, input, opts):
        """Reduce ``input`` (world size x ``output``) across ranks; rank r keeps slice r."""
        pieces = [[p.view(output.shape)] for p in input.reshape(self.size(), -1)]
        self._reduce_scatter("reduce_scatter_single", [output], pieces, opts.reduceOp)
        return _completed_work([output])

    _reduce_scatter_base = reduce_scatter_single  # the older name of the same op

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        """Several ``reduce_scatter_single`` in one call (reachable from C++)."""
        for output, input in zip(outputs, inputs):
            self.reduce_scatter_single(output, input, opts)
        return _completed_work(outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts):
        """List form: rank r gets the reduction of every rank's ``input_tensors[i][r]``."""
        pieces = [[inputs[d] for inputs in input_tensors] for d in range(self.size())]
        self._reduce_scatter("reduce_scatter", output_tensors, pieces, opts.reduceOp)
        return _completed_work(output_tensors)

    def _all_to_all(self, op, outputs, inputs):
        """Rank s's ``inputs[d]`` lands in rank d's ``outputs[s]``."""
        got = self._exchange(op, False, {d: [inputs[d]] for d in self._others()},
                             {s: [outputs[s]] for s in self._others()})
        for s, out in enumerate(outputs):
            out.copy_(inputs[s] if s == self.rank() else got[s][0])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        """Split ``input`` along dim 0 (evenly or by ``input_split_sizes``) and exchange."""
        n = self.size()
        outs = output.split(list(output_split_sizes) or output.shape[0] // n)  # views
        ins = input.split(list(input_split_sizes) or input.shape[0] // n)
        self._all_to_all("all_to_all_single", outs, ins)
        return _completed_work([output])

    alltoall_base = all_to_all_single  # the older name of the same op

    def alltoall(self, output_tensors, input_tensors, opts):
        """List form of all-to-all: ``input_tensors[d]`` goes to rank d."""
        self._all_to_all("alltoall", output_tensors, input_tensors)
        return _completed_work(output_tensors)

    def barrier(self, opts=None):
        """Return once every rank of the group has entered the barrier."""
        self._exchange("barrier", True, {_ALL: []}, dict.fromkeys(self._others(), []))
        return _completed_work([])

    # -- point to point ----------------------------------------------------------------
    def _p2p_key(self, direction, src, dst, tag):
        n = self._p2p.get((direction, src, dst, tag), 0)  # messages so far on this channel
        self._p2p[(direction, src, dst, tag)] = n + 1
        return f"p2p/{src}>{dst}/{tag}/{n}"

    def send(self, tensors, dstRank, tag):
        """Buffered send: the message waits in the store until ``dstRank`` receives it."""
        self._put(self._p2p_key("send", self.rank(), dstRank, tag), _as_bytes(tensors))
        return _completed_work(tensors)

    def recv(self, tensors, srcRank, tag):
        """Receive the next message with ``tag`` from ``srcRank`` into ``tensors``."""
        key = self._p2p_key("recv", srcRank, self.rank(), tag)
        datas, counts = self._fetch("recv", {srcRank: key}, {srcRank: _nbytes(tensors)})
        self._delete(key, counts[srcRank])
        for t, value in zip(tensors, _from_bytes(datas[srcRank], tensors)):
            t.copy_(value)
        return _completed_work(tensors)

    def recv_anysource(self, tensors, tag):
        """Not supported: a store cannot wait for "any one of" several keys."""
        raise NotImplementedError(f"{self._name} backend: recv from any source is not supported")

    def shutdown(self):
        """Check out of the group (``destroy_process_group`` calls this).

        Waits until every rank has checked out, so that a rank hosting the store does not
        exit while its peers still read from it. The wait is short (``SHUTDOWN_WAIT``): a
        crashed rank must not make its peers' clean-up hang.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._store.add("shutdown", 1) == self.size():
                self._store.set("shutdown/all", b"")
            self._store.wait(["shutdown/all"], min(self._timeout, SHUTDOWN_WAIT))
            if self._store.add("shutdown/out", 1) == self.size():  # nobody waits any more
                for k in ("shutdown", "shutdown/all", "shutdown/out"):
                    self._store.delete_key(k)
        except RuntimeError as err:
            warnings.warn(f"{self._name} backend: shut down without every rank: {err}",
                          stacklevel=2)
