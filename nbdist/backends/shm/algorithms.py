"""The collective algorithms of ``nbdist_shm``, on flat contiguous CPU tensors.

Every algorithm is a fixed sequence of phases (see :mod:`nbdist.shm.sync`), the same on every
rank once the ranks agree on the call: the first phase of every call carries a *fingerprint*
(op, dtype, sizes, root, reduce op) that the ranks compare before using any data, so
mismatched calls fail with a message that shows both calls. Tensors larger than a chunk
(``CACHE_CHUNK_BYTES``, or half a slot) move in chunks, one or two phases each. The math is
done with torch ops on views of the slots (they release the GIL and run at memory speed).
Reductions combine contributions in rank order (with two ranks and an exactly commutative
op, in place), so every rank gets bit-identical results.

* all_reduce, small (<= ``SMALL_BYTES``) or 2 ranks: per chunk, everyone writes its data,
  one phase, every rank reduces all slots itself (one round trip: low latency).
* all_reduce, large, 3+ ranks, per chunk: phase 1, everyone writes the pieces the others
  reduce, and reduces its own 1/N piece across all slots into the other half of its slot;
  phase 2, everyone copies the N reduced pieces out. Each rank reads and writes about 3x the
  tensor, whatever N: near memcpy speed.
* reduce: the same, but only the root copies out (small: only the root reduces).
* broadcast: the root writes a chunk, the others copy it out; the root fills the next half
  while they read (pipelined).
* all_gather: everyone writes its chunk, everyone copies every slot out.
* reduce_scatter: everyone writes its N pieces, rank r reduces piece r of every slot.
* all_to_all: everyone writes its N pieces (sizes published in the first phase), rank r
  copies piece r of every slot.
"""
from __future__ import annotations

import math

__all__ = ["CACHE_CHUNK_BYTES", "SMALL_BYTES", "Algorithms"]

SMALL_BYTES = 256 << 10
"""all_reduce / reduce of at most this many bytes take the one-phase path."""

CACHE_CHUNK_BYTES = 4 << 20
"""Chunk size when every rank has a core of its own (measured with 2 ranks, 64-256 MiB
all_reduce: 4-8 MiB chunks 10-20% faster than 1 or 16 MiB ones). With fewer cores than ranks
every phase costs context switches, so chunks are as large as the slots allow (half a slot)."""

_LINE = 64  # piece boundaries are aligned to cache lines


def _cut(count, parts, itemsize):
    """Boundaries splitting ``count`` elements into ``parts`` pieces, aligned to cache lines."""
    step = max(1, _LINE // itemsize)
    return [(count * j // parts) // step * step for j in range(parts)] + [count]


class Algorithms:
    """The algorithms for one rank of one group: ``seg`` (Segment), ``sync`` (Sync)."""

    def __init__(self, seg, sync, mismatch):
        """``mismatch(op, p, words, ranks)`` raises when a peer's fingerprint differs."""
        self.seg, self.sync, self.mismatch = seg, sync, mismatch
        self.rank, self.size = sync.rank, sync.size
        self.all = list(range(self.size))
        self.half = seg.half_bytes
        # rank 0's core count (seg.cores), the same on every rank: all cut tensors alike
        self.chunk = min(self.half, CACHE_CHUNK_BYTES) if self.size <= seg.cores else self.half
        # One phase per chunk, every rank reducing the whole chunk, costs N reads per element
        # but half the waits: the better trade for two ranks. Two phases above that.
        self.one_phase = self.size <= 2
        self._cache = {}
        self._written = [None, None]  # the fingerprint last written per phase parity

    # -- phase helpers ---------------------------------------------------------------------
    def _open(self, op, fp):
        """Start a call: guard the next phase and publish the fingerprint. Returns the phase."""
        p = self.sync.phase + 1
        self.sync.guard(p, op)
        if self._written[p & 1] != fp:  # repeated calls (training loops) skip the writes
            self.seg.set_fingerprint(self.rank, p, fp)
            self._written[p & 1] = fp
        return p

    def _next(self, op):
        """A later phase of the same call that writes data: guard it. Returns the phase."""
        p = self.sync.phase + 1
        self.sync.guard(p, op)
        return p

    def _meet(self, op, p, ranks, fp=None, expect=None):
        """Arrive at ``p``, wait for ``ranks``; on a call's first phase compare fingerprints."""
        self.sync.arrive(p)
        self.sync.wait(ranks, p, op)
        if fp is not None:
            self.mismatch(op, p, fp, ranks, expect)

    def _view(self, rank, p, start, count, dtype):
        itemsize = dtype.itemsize
        return self.seg.half(rank, p)[start * itemsize:(start + count) * itemsize].view(dtype)

    def _views(self, p, start, count, dtype):
        """Every rank's ``_view``, cached: slicing costs microseconds, calls repeat."""
        key = (p & 1, start, count, dtype)
        views = self._cache.get(key)
        if views is None:
            if len(self._cache) >= 256:
                self._cache.clear()
            views = self._cache[key] = [self._view(j, p, start, count, dtype) for j in self.all]
        return views

    def close(self):
        """Drop the cached views of the segment (before it is unmapped)."""
        self._cache.clear()

    # -- reductions ------------------------------------------------------------------------
    def all_reduce(self, op, flat, combine, fp, root=None):
        """Reduce ``flat`` across ranks in place (``root`` given: a reduce into the root only)."""
        dtype, n = flat.dtype, flat.numel()
        readers = self.all if root is None or root == self.rank else []
        if n * dtype.itemsize <= SMALL_BYTES or self.size == 1 or self.one_phase:
            chunk = self.chunk // dtype.itemsize // _LINE * _LINE
            for i, start in enumerate(range(0, max(n, 1), chunk)):
                count = min(chunk, n - start)
                mine = flat if count == n else flat[start:start + count]
                p = self._open(op, fp) if i == 0 else self._next(op)
                views = self._views(p, 0, count, dtype)
                views[self.rank].copy_(mine)
                self._meet(op, p, readers, fp if i == 0 else None)
                if readers:
                    combine(mine, views, own=self.rank)
            return
        chunk = self.chunk // dtype.itemsize // _LINE * _LINE
        for i, start in enumerate(range(0, n, chunk)):
            count = min(chunk, n - start)
            cuts = _cut(count, self.size, dtype.itemsize)
            lo, hi = cuts[self.rank], cuts[self.rank + 1]
            mine = flat[start:start + count]
            p = self._open(op, fp) if i == 0 else self._next(op)
            # peers only read their own pieces: skip copying this rank's piece in
            slot = self._view(self.rank, p, 0, count, dtype)
            slot[:lo].copy_(mine[:lo])
            slot[hi:].copy_(mine[hi:])
            self._meet(op, p, self.all, fp if i == 0 else None)
            # the reduced piece goes into the other half: phase p + 1's data (its guard,
            # everyone >= p, holds: we just waited for it)
            parts = [mine[lo:hi] if j == self.rank else self._view(j, p, lo, hi - lo, dtype)
                     for j in self.all]
            combine(self._view(self.rank, p + 1, lo, hi - lo, dtype), parts)
            self._meet(op, p + 1, readers)
            for j in readers:
                a, b = cuts[j], cuts[j + 1]
                mine[a:b].copy_(self._view(j, p + 1, a, b - a, dtype))

    def reduce_scatter(self, op, out, inp, combine, fp):
        """``out`` (m elements) = reduction over ranks of block ``rank`` of ``inp`` (N x m)."""
        dtype, m, n = out.dtype, out.numel(), self.size
        stride = self.chunk // n // _LINE * _LINE // dtype.itemsize  # elements per piece
        blocks = inp.view(n, m)
        for i, start in enumerate(range(0, max(m, 1), stride)):
            count = min(stride, m - start)
            p = self._open(op, fp) if i == 0 else self._next(op)
            if count:
                mine = self._view(self.rank, p, 0, n * stride, dtype).view(n, stride)
                mine[:, :count].copy_(blocks[:, start:start + count])
            self._meet(op, p, self.all, fp if i == 0 else None)
            if count:
                off = self.rank * stride
                combine(out[start:start + count],
                        [self._view(j, p, off, count, dtype) for j in self.all])

    # -- data movement (bytes) -------------------------------------------------------------
    def broadcast(self, op, flat, root, fp):
        """Copy the root's ``flat`` (uint8) into every rank's ``flat``."""
        n = flat.numel()
        for i, start in enumerate(range(0, max(n, 1), self.chunk)):
            count = min(self.chunk, n - start)
            if self.rank == root:
                p = self._open(op, fp) if i == 0 else self._next(op)
                self.seg.half(root, p)[:count].copy_(flat[start:start + count])
                self.sync.arrive(p)
            else:
                p = self.sync.phase + 1  # reads only: no guard, no fingerprint of its own
                self._meet(op, p, [root], fp if i == 0 else None)
                flat[start:start + count].copy_(self.seg.half(root, p)[:count])

    def all_gather(self, op, inp, outs, fp, expect=None):
        """``outs[j]`` (uint8) receives rank j's ``inp`` (uint8); sizes may differ by rank."""
        longest = max(o.numel() for o in outs)
        for i, start in enumerate(range(0, max(longest, 1), self.chunk)):
            p = self._open(op, fp) if i == 0 else self._next(op)
            mine = inp[start:start + self.chunk]
            self.seg.half(self.rank, p)[:mine.numel()].copy_(mine)
            self._meet(op, p, self.all, fp if i == 0 else None, expect)
            for j, out in enumerate(outs):
                piece = out[start:start + self.chunk]
                piece.copy_(self.seg.half(j, p)[:piece.numel()])

    def all_to_all(self, op, sends, recvs, fp):
        """``recvs[s]`` (uint8) receives rank s's ``sends[rank]``; sizes are checked first."""
        n = self.size
        stride = self.chunk // n // _LINE * _LINE
        p = self._open(op, fp)
        self.seg.set_meta(self.rank, p, [s.numel() for s in sends])
        phases, i = 1, 0
        while i < phases:
            if i:
                p = self._next(op)
            buf = self.seg.half(self.rank, p)
            for d, s in enumerate(sends):
                piece = s[i * stride:(i + 1) * stride]
                buf[d * stride:d * stride + piece.numel()].copy_(piece)
            self._meet(op, p, self.all, fp if i == 0 else None)
            if i == 0:  # every rank computes the same count from the same published sizes
                sizes = [self.seg.meta(s, p) for s in range(n)]
                self._check_sizes(op, p, sizes, recvs)
                phases = max(1, max(math.ceil(b / stride) for row in sizes for b in row[:n]))
            for s, r in enumerate(recvs):
                piece = r[i * stride:(i + 1) * stride]
                src = self.seg.half(s, p)[self.rank * stride:]
                piece.copy_(src[:piece.numel()])
            i += 1

    def _check_sizes(self, op, p, sizes, recvs):
        for s, r in enumerate(recvs):
            if sizes[s][self.rank] != r.numel():
                self.sync.fail(
                    f"{self.sync.where(op)}: mismatched splits: rank {s} sends "
                    f"{sizes[s][self.rank]} bytes to rank {self.rank}, which expects "
                    f"{r.numel()} bytes from it. Every rank's output_split_sizes must match "
                    "the input_split_sizes of its peers.")

    def barrier(self, op, fp):
        """Return once every rank has entered the barrier."""
        p = self._open(op, fp)
        self._meet(op, p, self.all, fp)
