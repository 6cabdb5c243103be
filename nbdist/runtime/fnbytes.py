"""A function's pickled request, made once and sent again while nothing it was made from can
have changed (issue 39: the trivial call).

``g.run(fn)`` sends ``fn`` by value: cloudpickle writes its code, the globals it reads, its
defaults and closure. For the same ``fn`` called again, with no arguments, those bytes are the same
as long as every value they were made from is the same object and cannot have changed in place.
This module keeps the bytes of such calls and checks, before each reuse, that this still holds:

* only plain functions that travel by value (defined in ``__main__`` -- a notebook -- or in a
  module nobody can import), called with no arguments;
* every value cloudpickle writes -- the globals the code (and the code nested in it) reads, the
  module's ``__name__``/``__package__``/``__file__``/``__path__``, the defaults, the closure's
  cells, the function's name, qualified name, module and doc string -- is an immutable plain value
  (``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``) or a module imported
  under its name (which travels by name), and is the very object it was when the bytes were made;
* the function has no attributes of its own, no annotations and no keyword-only defaults;
* cells are named by the same hook (:data:`.cells.CELLS`), as many modules are imported as then
  (cloudpickle also writes which imported submodules the code reaches), the same modules are
  registered to travel by value (:func:`cloudpickle.register_pickle_by_value`), and none of those
  the function reads is one of them, inside one, or has a submodule that is.

The bytes are made from a copy of the function over those values (:class:`Plan`), not from the
function itself, so a value another thread changes while they are made cannot get into them
unseen. Anything else -- a function that reads a list, a tensor, a model, another notebook
function, or takes arguments -- is pickled afresh on every call, as before. Nothing here changes
what the ranks receive: only whether it is pickled again.

Threads: any thread making a call may look up and keep; each entry is put and read whole (one dict
operation under the GIL), so no lock is taken.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import cloudpickle

from . import cells

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_BASE = ("__package__", "__name__", "__path__", "__file__")  #: module names cloudpickle writes
_MISSING = object()
MAX_ENTRIES = 64  #: functions whose bytes are kept (the oldest is dropped beyond)
MAX_BYTES = 64 * 1024  #: larger requests (or cell texts) are not kept: they carry data
# the globals cloudpickle writes for a code object; every name the code loads where it is gone
_code_globals = getattr(getattr(cloudpickle, "cloudpickle", None), "_extract_code_globals", None)


class Plan(NamedTuple):
    """What to pickle for a function that may be kept, and what its bytes are made from."""

    code: types.CodeType
    names: tuple  #: the globals its code reads
    head: tuple  #: compared by equality: the cell hook, modules imported, modules by value
    values: tuple  #: compared by identity: everything else the bytes are made from
    copy: types.FunctionType  #: the function over ``values``: what is pickled


#: ``id(code)`` -> ``(plan, payload, texts)``; the plan holds the code object, so its id is not
#: reused while the entry lives
_kept: Dict[int, Tuple[Plan, bytes, Dict[str, str]]] = {}


def _names(code: types.CodeType) -> tuple:
    """The globals ``code`` (and the code nested in it) reads, as cloudpickle finds them."""
    if _code_globals is not None:
        return tuple(_code_globals(code))
    out = dict.fromkeys(code.co_names)  # a superset: attribute names too
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.update(dict.fromkeys(_names(const)))
    return tuple(out)


def _values(fn: types.FunctionType, names: tuple) -> Optional[tuple]:
    """Every object ``fn``'s bytes are made from, in a fixed order; ``None`` where ``fn`` has what
    this module does not follow."""
    if fn.__dict__ or fn.__kwdefaults__ or fn.__annotations__:
        return None
    try:
        closure = tuple(c.cell_contents for c in fn.__closure__ or ())
    except ValueError:  # a cell not filled yet
        return None
    g = fn.__globals__
    defaults = fn.__defaults__ or ()
    return (fn.__name__, fn.__qualname__, fn.__module__, fn.__doc__, len(defaults), *defaults,
            *closure, *(g.get(n, _MISSING) for n in _BASE), *(g.get(n, _MISSING) for n in names))


def _same(kept: Plan, head: tuple, values: tuple) -> bool:
    return kept.head == head and len(kept.values) == len(values) and all(
        a is b for a, b in zip(kept.values, values))


def _head(by_value) -> tuple:
    return cells.CELLS, len(sys.modules), by_value


def _by_value(name: str, by_value) -> bool:
    """Whether module ``name`` travels by value, or a package above it or a module below does."""
    return any(name == m or name.startswith(m + ".") or m.startswith(name + ".")
               for m in by_value)


def _fixed(value: Any, by_value) -> bool:
    if value is _MISSING or type(value) in _PLAIN:
        return True
    return isinstance(value, types.ModuleType) and sys.modules.get(value.__name__) is value \
        and not _by_value(value.__name__, by_value)


def _modules_in_place(values: tuple) -> bool:
    return all(sys.modules.get(v.__name__) is v for v in values
               if isinstance(v, types.ModuleType))


def _copy(fn: types.FunctionType, names: tuple, values: tuple) -> types.FunctionType:
    """``fn`` over ``values``: its code, with globals, defaults and closure as they were read."""
    n_defaults = values[4]
    defaults = values[5:5 + n_defaults]
    n_closure = len(fn.__code__.co_freevars)
    closure = values[5 + n_defaults:5 + n_defaults + n_closure]
    rest = values[5 + n_defaults + n_closure:]
    scope = {n: v for n, v in zip(_BASE + names, rest) if v is not _MISSING}
    copy = types.FunctionType(fn.__code__, scope, values[0], defaults or None,
                              tuple(types.CellType(v) for v in closure) or None)
    copy.__qualname__, copy.__module__, copy.__doc__ = values[1], values[2], values[3]
    return copy


def find(fn: Callable, args: tuple, kwargs) -> Tuple[Optional[tuple], Optional[Plan]]:
    """``(hit, plan)``: ``hit`` is ``(payload, cell texts)`` kept for ``fn`` called with no
    arguments and still valid (else ``None``); ``plan`` (else ``None``): ``fn`` may be kept --
    pickle ``plan.copy`` instead of ``fn`` and pass the result to :func:`keep`."""
    if args or kwargs or type(fn) is not types.FunctionType:
        return None, None
    module = fn.__module__
    if module != "__main__" and (not isinstance(module, str) or module in sys.modules):
        return None, None  # travels by reference (or cloudpickle decides): nothing to keep
    entry = _kept.get(id(fn.__code__))
    kept = entry[0] if entry is not None and entry[0].code is fn.__code__ else None
    names = kept.names if kept is not None else _names(fn.__code__)
    values = _values(fn, names)
    if values is None:
        return None, None
    head = _head(cloudpickle.list_registry_pickle_by_value())
    if kept is not None and _same(kept, head, values) and _modules_in_place(values):
        return (entry[1], entry[2]), None
    if not all(_fixed(v, head[2]) for v in values):
        return None, None
    return None, Plan(fn.__code__, names, head, values, _copy(fn, names, values))


def keep(plan: Optional[Plan], payload: bytes, texts: Dict[str, str]) -> None:
    """Keep ``payload`` (made from ``plan.copy``) and the cell ``texts`` it names for the next
    call, unless something its bytes depend on changed while they were made."""
    if plan is None or len(payload) + sum(map(len, texts.values())) > MAX_BYTES \
            or _head(cloudpickle.list_registry_pickle_by_value()) != plan.head:
        return
    _kept.pop(id(plan.code), None)
    while len(_kept) >= MAX_ENTRIES:
        try:
            _kept.pop(next(iter(_kept)), None)
        except (StopIteration, RuntimeError):  # emptied, or changed by another thread
            break
    _kept[id(plan.code)] = (plan, payload, dict(texts))


def clear() -> None:
    """Forget every kept request."""
    _kept.clear()
