"""Pickling for the control channel: code by value (cloudpickle), CPU tensors through shared memory.

A large CPU tensor is not pickled byte by byte. Its data is copied once into a file in ``/dev/shm``
(a temp dir where there is none) and the message carries only the file name, dtype and shape; the
receiver maps the file (``torch.from_file``), so the bytes never pass through a socket. Files are
named ``nbdist-<group id>-...`` so that a group can remove anything a crash left behind.

Where there are no shared files (Windows, ``NBDIST_TENSORS=message``, ranks on other hosts), a
large CPU tensor's bytes travel inside the message as one out-of-band-style buffer (pickle protocol
5's ``PickleBuffer``): written once into the stream, rebuilt with ``torch.frombuffer`` over the
bytes the unpickler made -- not through ``torch.save`` / ``torch.load``, which torch's own
reduction of a tensor uses.

Results travelling worker -> caller go into segments a worker reuses (see :mod:`nbdist.wire.pool`);
values pushed caller -> workers are mapped private (copy-on-write) by every rank and unlinked by the caller
once all ranks have answered.
"""
from __future__ import annotations

import io
import itertools
import os
import pickle
import sys
import types
from typing import Any, Callable, List, Optional

import cloudpickle

from . import mappings
from .pool import copy_into, rebuild_pooled
from .segments import SHM_MIN_BYTES, remove_segments, write_all

_counter = itertools.count()


def _rebuild_inline(data: bytearray, dtype, shape, requires_grad: bool, is_param: bool):
    import torch

    tensor = torch.frombuffer(data, dtype=dtype).view(shape) if len(data) else \
        torch.empty(shape, dtype=dtype)
    return _finish(torch, tensor, requires_grad, is_param)


def _finish(torch, tensor, requires_grad: bool, is_param: bool):
    if is_param:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _rebuild_tensor(path: str, dtype, shape, requires_grad: bool, is_param: bool, private: bool,
                    unlink: bool):
    import torch

    numel = 1
    for s in shape:
        numel *= s
    if mappings.NAMED and private:  # Windows: copied out, the view closed before anything runs
        return _finish(torch, _copied_out(torch, path, dtype, shape, numel), requires_grad,
                       is_param)
    if mappings.NAMED:  # Windows: a view of the sender's mapping
        buf = mappings.open_existing(path, numel * dtype.itemsize)
        tensor = torch.frombuffer(buf, dtype=dtype, count=numel).view(shape) if numel else \
            torch.empty(shape, dtype=dtype)
        return _finish(torch, tensor, requires_grad, is_param)
    tensor = torch.from_file(path, shared=not private, size=numel, dtype=dtype).view(shape)
    if unlink:
        remove_segments([path])
    return _finish(torch, tensor, requires_grad, is_param)


def _copied_out(torch, path: str, dtype, shape, numel: int):
    """A tensor of its own with the bytes of the sender's mapping ``path``, whose view is closed
    on return: the sender reuses the mapping once every receiver answered (:mod:`.mappings`)."""
    tensor = torch.empty(shape, dtype=dtype)
    if not numel:
        return tensor
    buf = mappings.open_existing(path, numel * dtype.itemsize)
    try:
        src = torch.frombuffer(buf, dtype=torch.uint8, count=numel * dtype.itemsize)
        tensor.view(-1).view(torch.uint8).copy_(src)
        del src  # the view exported to torch: gone before the close
    finally:
        buf.close()
    return tensor


# cloudpickle's reduction of a code object, which writes "<dynamic-code>" for its file name
_code_reduce = getattr(getattr(cloudpickle, "cloudpickle", None), "_code_reduce", None)


def _named_code(code: types.CodeType, filename: str):
    """cloudpickle's reduction of ``code``, with ``filename`` where it writes ``<dynamic-code>``."""
    make, args = _code_reduce(code)
    args = list(args)
    args[args.index("<dynamic-code>")] = filename
    return make, tuple(args)


class Pickler(cloudpickle.Pickler):
    """cloudpickle, plus large CPU tensors written to shared-memory files instead of the stream.

    ``prefix`` is the segment path prefix (``None``: no shared memory, e.g. for a remote peer);
    ``private`` and ``unlink`` tell the receiver how to map and whether to unlink.
    ``created`` lists the files this pickler made.

    ``code_names``: code shipped by value keeps a file name (cloudpickle writes
    ``<dynamic-code>`` in every code object): ``code_names(co_filename)`` gives the name it
    travels under (a notebook cell's label, say), or ``None`` to keep its own.
    """

    def __init__(self, file, prefix: Optional[str], private: bool, unlink: bool, pool=None,
                 code_names: Optional[Callable[[str], Optional[str]]] = None):
        super().__init__(file, protocol=5)
        self.pool = pool
        self.prefix = prefix
        self.private = private
        self.unlink = unlink
        self.created: List[str] = []
        self.pooled: List[str] = []
        self.code_names = code_names if _code_reduce is not None else None

    def reducer_override(self, obj):
        kind = type(obj)
        if kind is types.CodeType and self.code_names is not None:
            return _named_code(obj, self.code_names(obj.co_filename) or obj.co_filename)
        torch = sys.modules.get("torch")
        if torch is not None and kind in (torch.Tensor, torch.nn.Parameter):
            reduced = self._reduce_tensor(obj, torch)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _reduce_tensor(self, t, torch):
        if (t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized
                or t.is_complex() or t.is_nested
                or t.numel() * t.element_size() < SHM_MIN_BYTES):
            return None
        data = t.detach().contiguous()
        is_param = isinstance(t, torch.nn.Parameter)
        requires_grad = bool(t.requires_grad and (t.is_leaf or is_param))
        if self.pool is None and self.prefix is None:  # inside the message: its bytes, once
            raw = memoryview(data.view(-1).view(torch.uint8).numpy())
            return (_rebuild_inline, (pickle.PickleBuffer(raw), data.dtype, tuple(data.shape),
                                      requires_grad, is_param))
        if self.pool is not None:
            path, nbytes = self.pool.store(data)
            self.pooled.append(path)
            return (rebuild_pooled, (path, nbytes, data.dtype, tuple(data.shape), requires_grad,
                                     is_param))
        path = f"{self.prefix}{os.getpid()}-{next(_counter)}"
        if mappings.NAMED:  # Windows: held here until every receiver answered (segments.let_go)
            nbytes = data.numel() * data.element_size()
            reused = mappings.reuse(self.prefix, nbytes) if self.private else None
            path, buf = reused or (path, mappings.create(path, nbytes))
            self.created.append(path)
            copy_into(buf, data.view(-1).view(torch.uint8), nbytes)
            return (_rebuild_tensor,
                    (path, data.dtype, tuple(data.shape), requires_grad, is_param, self.private,
                     self.unlink))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        self.created.append(path)
        try:
            write_all(fd, memoryview(data.view(-1).view(torch.uint8).numpy()))
        finally:
            os.close(fd)
        return (_rebuild_tensor,
                (path, data.dtype, tuple(data.shape), requires_grad, is_param, self.private,
                 self.unlink))


_PLAIN = (type(None), bool, int, float, str)  #: pickled as they are, by plain pickle


def dumps(obj: Any, prefix: Optional[str] = None, private: bool = False,
          unlink: bool = True, pool=None,
          code_names: Optional[Callable[[str], Optional[str]]] = None):
    """Pickle ``obj`` by value; returns ``(bytes, segment_paths)`` (files made, or pooled segments
    lent, for the tensors in ``obj``). ``code_names``: see :class:`Pickler`.

    On failure every segment already written is removed (or given back to ``pool``) before the
    error propagates.
    """
    if type(obj) in _PLAIN:  # nothing for cloudpickle to do (a call's usual None, a number)
        return pickle.dumps(obj, protocol=5), []
    buf = io.BytesIO()
    pickler = Pickler(buf, prefix, private, unlink, pool, code_names)
    try:
        pickler.dump(obj)
    except BaseException:
        remove_segments(pickler.created)
        if pool is not None:
            pool.release(pickler.pooled)
        raise
    return buf.getvalue(), pickler.created + pickler.pooled


def loads(data: bytes) -> Any:
    """Unpickle what :func:`dumps` produced (only ever called on authenticated peers' data)."""
    return cloudpickle.loads(data)
