"""Where the code a rank runs came from: a notebook cell's label (``Cell In[5]``) and its text.

A function defined in a cell travels by value; its code keeps the name of its cell (not
cloudpickle's ``<dynamic-code>``), and the cell's text reaches each rank once, before the first
call that needs it, into the rank's :mod:`linecache`. Tracebacks, ``g.stacks()``, the hang
analysis, pdb and warnings on the ranks then show the cell and the line, as IPython does for a
local cell. ``%%dist`` / ``%dist`` / ``g.exec`` source found in the cell that sent it runs under
the cell's name, its lines counted as in the cell.

Which file is a cell, and its label and text, is the kernel's to say: the notebook layer sets
:data:`CELLS` (this module never imports IPython). Without it, code from an unnamed file the
kernel holds in :mod:`linecache` keeps that file's name and text; code from a real file keeps its
path and line.

Kernel side: :class:`Naming` (a request's pickler names code with it), :func:`locate` (exec
source in its cell), :func:`send_missing` (the texts a rank lacks, before a request).
Rank side: :func:`register`, :func:`keep_names_in_pdb`, :func:`shift`, :func:`format_failure`.
Both: :func:`place` and :func:`short`, a frame's place as people read it.
"""
from __future__ import annotations

import ast
import bdb
import linecache
import os
import re
import sys
import traceback
from typing import Callable, Dict, Optional, Tuple

from ..wire import transport

#: Set by the notebook layer: ``CELLS(filename)`` -> ``(label, text)`` for a file that is one of
#: the kernel's cells (``("Cell In[5]", "<the cell as typed>")``), else ``None``.
CELLS: Optional[Callable[[str], Optional[Tuple[str, str]]]] = None

_NBDIST = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: nbdist's machinery on a rank (the serving loop, the collective recorder's wrapper, the wire):
#: frames a remote traceback leaves out, as IPython leaves out its own
OWN = tuple(os.path.join(_NBDIST, part) + os.sep for part in ("runtime", "wire"))
_CELL_FRAME = re.compile(r'File "(Cell [^"\n]*)", line ')
_joined: Dict[str, Tuple[list, str]] = {}


# ---- kernel side ----------------------------------------------------------------------------------
def cell_of(filename: str) -> Optional[Tuple[str, str]]:
    """``(name, text)`` for code from ``filename`` that the ranks cannot read from a file: a cell
    (:data:`CELLS`), or a file held only in this process's :mod:`linecache`. ``None``: a real
    file (or no text at all), which keeps its own name."""
    hook = CELLS
    if hook is not None:
        found = hook(filename)
        if found is not None:
            return found
    entry = linecache.cache.get(filename)
    if entry is None or len(entry) != 4 or entry[1] is not None or not entry[2]:
        return None
    lines = entry[2]
    joined = _joined.get(filename)
    if joined is None or joined[0] is not lines:
        joined = _joined[filename] = (lines, "".join(lines))
    return filename, joined[1]


class Naming:
    """The name each code object travels under (``Pickler(code_names=...)``), and ``texts``:
    the text of every cell named so far, by name."""

    def __init__(self):
        self.texts: Dict[str, str] = {}

    def __call__(self, filename: str) -> Optional[str]:
        found = cell_of(filename)
        if found is None:
            return None
        self.texts[found[0]] = found[1]
        return found[0]


def locate(source: str) -> Optional[Tuple[str, str, int, int]]:
    """Where exec'd ``source`` is written in the cell whose code sent it (the nearest calling
    frame from a cell): ``(label, cell text, lines before it, columns before it)``; the text is
    ``""`` where the source is not written there as it is (a string built in code, with escapes):
    it then runs as ``<string in LABEL>``. ``None``: not sent from a cell."""
    hook = CELLS
    if hook is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        found = hook(frame.f_code.co_filename)
        if found is not None:
            break
        frame = frame.f_back
    else:
        return None
    label, text = found
    probe = source.rstrip()
    start = 0
    for _ in range((frame.f_lineno or 1) - 1):  # the source follows the call's line
        start = text.find("\n", start) + 1
        if start == 0:
            start = len(text)
            break
    at = text.find(probe, start) if probe else -1
    if at < 0:
        return f"<string in {label}>", "", 0, 0
    before = text.rfind("\n", 0, at) + 1
    return label, text, text.count("\n", 0, at), at - before


def send_missing(rank, texts: Dict[str, str]) -> None:
    """Send ``rank`` the texts it lacks (a ``src`` message, before the request that needs them);
    each reaches a rank once (again only if its text changed)."""
    if not texts:
        return
    sent = rank.cells
    new = {name: text for name, text in texts.items() if sent.get(name) != text}
    if new:
        rank.channel.send_bytes(transport.encode(("src", 0, new)))
        sent.update(new)


# ---- rank side ------------------------------------------------------------------------------------
def register(texts: Dict[str, str]) -> None:
    """Hold ``texts`` (name -> source) in this process's :mod:`linecache`, which tracebacks, pdb,
    ``inspect`` and warnings read (an entry without a time is never dropped as stale)."""
    for name, text in texts.items():
        linecache.cache[name] = (len(text), None, text.splitlines(True), name)


def keep_names_in_pdb() -> None:
    """pdb (``bdb.Bdb.canonic``) makes every file name but ``<...>`` an absolute path, and would
    look for ``/cwd/Cell In[5]`` on disk: a cell's name is kept as it is (once per process)."""
    original = bdb.Bdb.canonic
    if getattr(original, "nbdist_cells", False):
        return

    def canonic(self, filename):
        if filename.startswith("Cell ") and filename in linecache.cache:
            return filename
        return original(self, filename)

    canonic.nbdist_cells = True
    bdb.Bdb.canonic = canonic


def shift(tree: ast.AST, lines: int, columns: int) -> ast.AST:
    """``tree`` (parsed from a piece of a cell) moved to where the piece starts in the cell:
    ``lines`` down, and its first line ``columns`` right."""
    if columns:
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) == 1 and hasattr(node, "col_offset"):
                node.col_offset += columns
            if getattr(node, "end_lineno", None) == 1 and \
                    getattr(node, "end_col_offset", None) is not None:
                node.end_col_offset += columns
    if lines:
        ast.increment_lineno(tree, lines)
    return tree


def format_failure(exc: BaseException) -> str:
    """``exc`` with its traceback, as Python prints it, without nbdist's frames, and a cell's
    frames as IPython shows them: ``Cell In[5], line 4, in scale`` and the line."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    seen: set = set()
    todo = [te]
    while todo:
        one = todo.pop()
        if id(one) in seen:
            continue
        seen.add(id(one))
        frames = [f for f in one.stack if not f.filename.startswith(OWN)]
        if len(frames) != len(one.stack):
            one.stack = traceback.StackSummary.from_list(frames)
        todo.extend(t for t in (one.__cause__, one.__context__) if t is not None)
        todo.extend(getattr(one, "exceptions", None) or ())
    return _CELL_FRAME.sub(r"\1, line ", "".join(te.format()))


# ---- both -----------------------------------------------------------------------------------------
def is_cell(filename: str) -> bool:
    """Whether ``filename`` names a cell (``Cell In[5]``) or exec'd text (``<...>``), not a file."""
    return filename.startswith(("Cell ", "<"))


def place(filename: str, line: int) -> str:
    """A frame's place in full: ``Cell In[5], line 4``; ``file.py:12`` for a file."""
    return f"{filename}, line {line}" if filename.startswith("Cell ") else f"{filename}:{line}"


def short(filename: str, line: int, function: str) -> str:
    """A frame's place on one line: ``Cell In[5]:4 scale``, ``distributed_c10d.py:2950
    all_reduce`` (a file's base name)."""
    name = filename if is_cell(filename) else os.path.basename(filename)
    return f"{name}:{line} {function}"
