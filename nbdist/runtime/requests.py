"""What a call sends: each public call (run, exec, push, pull) checked and packed into a
:class:`Request` before anything reaches the ranks."""
from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

from ..wire import serialize
from . import cells, fnbytes


@dataclass
class Request:
    """One request, ready to send: ``kind`` and ``payload`` for the worker, ``what`` for people
    (status, errors), and the shared-memory ``segments`` to remove once every rank has answered."""

    kind: str
    payload: Any
    what: str
    segments: List[str] = field(default_factory=list)
    #: the text of each notebook cell the code comes from, by name: sent to a rank once
    cells: Dict[str, str] = field(default_factory=dict)


def _pickle(obj: Any, what: str, prefix: str, naming: Optional[cells.Naming] = None):
    try:
        return serialize.dumps(obj, prefix, private=True, unlink=False, code_names=naming)
    except Exception as err:  # noqa: BLE001 -- cloudpickle raises many types
        raise TypeError(f"cannot send the {what} to the ranks: it (or something it refers to) "
                        f"cannot be pickled: {type(err).__name__}: {err}. Define what it needs "
                        "on the ranks instead (e.g. with exec), or pass picklable data.") from err


def run_request(fn: Callable, args: Sequence, kwargs: Optional[Dict[str, Any]],
                prefix: Union[Optional[str], Callable[[], Optional[str]]]) -> Request:
    """``fn(*args, **kwargs)`` on the ranks; ``fn`` travels by value. ``prefix``: the segment
    prefix for its tensors, or a function that gives it (asked only if ``fn`` is pickled)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    name = getattr(fn, "__qualname__", type(fn).__name__)
    args, kwargs = tuple(args), dict(kwargs or {})
    hit, plan = fnbytes.find(fn, args, kwargs)  # the same function again: its bytes again
    if hit is not None:
        return Request("run", hit[0], f"run {name}", [], dict(hit[1]))
    naming = cells.Naming()  # code from notebook cells keeps its cell's name and text
    payload, segs = _pickle((fn if plan is None else plan.copy, args, kwargs), f"function {name}",
                            prefix() if callable(prefix) else prefix, naming)
    if plan is not None and not segs:
        fnbytes.keep(plan, payload, naming.texts)
    return Request("run", payload, f"run {name}", segs, naming.texts)


#: sources that compiled here (up to 256, each up to 64 KiB; then it starts over)
_COMPILED: Dict[str, None] = {}


def exec_request(source: str, filename: str) -> Request:
    """Python ``source`` run in the ranks' namespace (a SyntaxError shows here, no round trip).
    Source written in the notebook cell that sent it runs under the cell's name, at its lines
    there (:func:`.cells.locate`); other source under ``filename``."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str of Python code, got {type(source).__name__}")
    if source not in _COMPILED:  # the same source again (a loop, a cell re-run): checked once
        compile(source, filename, "exec")
        if len(source) <= 65536:
            if len(_COMPILED) >= 256:
                _COMPILED.clear()  # (atomic: another thread's call may be here too)
            _COMPILED[source] = None
    found = cells.locate(source)
    if found is None or not found[1]:  # the source's own text, under its own name
        name = filename if found is None else found[0]
        return Request("exec", (source, name, 0, 0, True), "exec")
    label, text, lines, columns = found
    return Request("exec", (source, label, lines, columns, False), "exec", cells={label: text})


def push_request(values: Dict[str, Any], prefix: str) -> Request:
    """Variables set in the ranks' namespaces (CPU tensors through shared memory)."""
    for name in values:
        if not is_variable_name(name):
            raise ValueError(f"push() names must be variable names, got {name!r}"
                             f"{keyword_note(name)}")
    naming = cells.Naming()  # a function pushed from a cell keeps its cell's name too
    payload, segs = _pickle(values, "pushed value", prefix, naming)
    return Request("push", payload, f"push {', '.join(values)}", segs, naming.texts)


def pull_request(names: Sequence[str]) -> Request:
    """Variables read from the ranks' namespaces."""
    if not names:
        raise ValueError("pull() needs at least one variable name, e.g. g.pull('loss')")
    for name in names:
        if not is_variable_name(name):
            raise ValueError(f"pull() takes variable names, got {name!r}{keyword_note(name)}")
    return Request("pull", tuple(names), f"pull {', '.join(names)}")


def debug_request(command: Optional[str]) -> Request:
    """One pdb command for a rank's kept failure (``None``: start; :mod:`.postmortem`)."""
    return Request("debug", command, "debug")


def is_variable_name(name: Any) -> bool:
    """Whether code can use a variable called ``name``: an identifier that is not a keyword
    (``"for"``, ``"None"``: ``str.isidentifier`` lets those through)."""
    return isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name)


def keyword_note(name: Any) -> str:
    """`` (a Python keyword)`` for a keyword, else ``""``: the end of a refusal's message."""
    return " (a Python keyword)" if isinstance(name, str) and keyword.iskeyword(name) else ""


def targets(ranks: Optional[Iterable[int]], world_size: int) -> List[int]:
    """The ranks a call goes to (default all), checked."""
    if ranks is None:
        return list(range(world_size))
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    out = sorted(set(ranks))
    bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int)
           or not 0 <= r < world_size]
    if bad or not out:
        raise ValueError(f"ranks must be ints in 0..{world_size - 1}, got {list(ranks)!r}")
    return out


def check_timeout(timeout: Optional[float]) -> Optional[float]:
    """A call's deadline in seconds (``None``: none)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return timeout
