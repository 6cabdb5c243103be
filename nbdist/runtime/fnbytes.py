"""A function's pickled request, made once and sent again while nothing it was made from can
have changed (issue 39: the trivial call).

``g.run(fn)`` sends ``fn`` by value: cloudpickle writes its code, the globals it reads, its
defaults and closure. For the same ``fn`` called again, with no arguments, those bytes are the same
as long as every value they were made from is the same object and cannot have changed in place.
This module keeps the bytes of such calls and checks, before each reuse, that this still holds:

* only plain functions (not methods, partials or callable objects), with no arguments;
* every value cloudpickle would write -- the globals the code (and the code nested in it) names,
  the module's ``__name__``/``__package__``/``__file__``/``__path__``, the defaults and the
  closure's cells -- is an immutable plain value (``None``, ``bool``, ``int``, ``float``,
  ``complex``, ``str``, ``bytes``) or an imported module (which travels by name), and is the very
  object it was when the bytes were made;
* the function has no attributes of its own, no annotations and no keyword-only defaults;
* its name, qualified name, module and doc string are the ones it had, cells are named by the same
  hook (:data:`.cells.CELLS`), no module was imported or removed meanwhile (cloudpickle also
  writes which imported submodules the code reaches), the modules registered to travel by value
  (:func:`cloudpickle.register_pickle_by_value`) are the same, and none of those it reads is one
  of them (or in one of them).

Anything else -- a function that reads a list, a tensor, a model, another notebook function, or
takes arguments -- is pickled afresh on every call, as before. Nothing here changes what the
ranks receive: only whether it is pickled again.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable, Dict, Optional, Tuple

import cloudpickle

from . import cells

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_BASE = ("__package__", "__name__", "__path__", "__file__")  #: module names cloudpickle writes
_MISSING = object()
MAX_ENTRIES = 64  #: functions whose bytes are kept (the oldest is dropped beyond)
MAX_BYTES = 64 * 1024  #: larger requests are not kept (they carry data, not just code)

#: ``id(code)`` -> ``(code, names, state, payload, texts)``; the code object is held, so its id
#: is not reused while the entry lives
_kept: Dict[int, Tuple[Any, tuple, tuple, bytes, Dict[str, str]]] = {}


def _names(code: types.CodeType) -> tuple:
    """Every name ``code`` and the code nested in it load (a superset of the globals it reads)."""
    out = dict.fromkeys(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            out.update(dict.fromkeys(_names(const)))
    return tuple(out)


def _state(fn: types.FunctionType, names: tuple, by_value: set) -> Optional[tuple]:
    """Every object ``fn``'s bytes are made from, in a fixed order; ``None`` where one of them
    could change in place or ``fn`` has what this module does not follow."""
    if fn.__dict__ or fn.__kwdefaults__ or fn.__annotations__:
        return None
    g = fn.__globals__
    defaults = fn.__defaults__ or ()
    try:
        closure = tuple(c.cell_contents for c in fn.__closure__ or ())
    except ValueError:  # a cell not filled yet
        return None
    return (cells.CELLS, len(sys.modules), by_value, fn.__name__, fn.__qualname__, fn.__module__,
            fn.__doc__, len(defaults), *defaults, *closure, *(g.get(n, _MISSING) for n in _BASE),
            *(g.get(n, _MISSING) for n in names))


_HEAD = 8  #: a state's entries before its values: compared by equality (the values: identity)


def _same(kept: tuple, now: tuple) -> bool:
    return len(kept) == len(now) and kept[:_HEAD] == now[:_HEAD] and all(
        a is b for a, b in zip(kept[_HEAD:], now[_HEAD:]))


def _fixed(value: Any, by_value: set) -> bool:
    if value is _MISSING or type(value) in _PLAIN:
        return True
    if not isinstance(value, types.ModuleType) or sys.modules.get(value.__name__) is not value:
        return False
    name = value.__name__  # travels by name, unless it (or its package) is registered by value
    return not any(name == m or name.startswith(m + ".") for m in by_value)


def find(fn: Callable, args, kwargs) -> Tuple[Optional[tuple], Optional[tuple]]:
    """``(hit, state)``: ``hit`` is ``(payload, cell texts)`` kept for ``fn`` called with no
    arguments and still valid (else ``None``); ``state`` is what to pass to :func:`keep` once the
    request is pickled (``None``: not to be kept). Taken before pickling, so a value changed by
    another thread meanwhile makes the next call pickle again."""
    if args or kwargs or type(fn) is not types.FunctionType:
        return None, None
    entry = _kept.get(id(fn.__code__))
    names = entry[1] if entry is not None and entry[0] is fn.__code__ else _names(fn.__code__)
    by_value = cloudpickle.list_registry_pickle_by_value()
    state = _state(fn, names, by_value)
    if state is None:
        return None, None
    if entry is not None and entry[0] is fn.__code__ and _same(entry[2], state):
        return (entry[3], entry[4]), None
    if not all(_fixed(v, by_value) for v in state[_HEAD:]):  # defaults, closure, globals
        return None, None
    return None, (fn.__code__, names, state)


def keep(state: Optional[tuple], payload: bytes, texts: Dict[str, str]) -> None:
    """Keep ``payload`` (and the cell ``texts`` it names) for the ``state`` :func:`find` gave."""
    if state is None or len(payload) > MAX_BYTES:
        return
    code, names, values = state
    _kept.pop(id(code), None)
    while len(_kept) >= MAX_ENTRIES:
        try:
            _kept.pop(next(iter(_kept)), None)
        except (StopIteration, RuntimeError):  # emptied, or changed by another thread
            break
    _kept[id(code)] = (code, names, values, payload, dict(texts))


def clear() -> None:
    """Forget every kept request."""
    _kept.clear()
