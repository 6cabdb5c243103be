"""The kernel's cells, named for the ranks: code that runs there from a cell shows as IPython
shows a local cell's, ``Cell In[5], line 4`` and the line (:mod:`nbdist.runtime.cells`).

:func:`install` sets :data:`nbdist.runtime.cells.CELLS` to :func:`cell_of`; ``import nbdist`` in
a kernel does it, and ``%load_ext nbdist``.
"""
from __future__ import annotations

import linecache
from typing import Dict, List, Optional, Tuple

from IPython import get_ipython

from ..runtime import cells

__all__ = ["cell_of", "install"]

_known: Dict[str, Tuple[int, int, str, str]] = {}  # filename -> (number, id(lines), label, text)


def install(shell=None) -> None:
    """Name cells for the ranks from now on, those of ``shell`` (default: the running IPython
    shell, found when first needed). Again changes nothing but the shell."""
    global _shell
    if shell is not None:
        _shell = shell
    cells.CELLS = cell_of


_shell = None


def cell_of(filename: str) -> Optional[Tuple[str, str]]:
    """``("Cell In[5]", the cell as typed)`` if ``filename`` is the code of a cell of the running
    IPython shell, else ``None``. The text is the cell's raw input where the history holds it
    (magics as typed: a ``%%dist`` cell's body is in it), else the code IPython compiled.
    Called for every code object a call sends: a file that is no cell costs a dict look-up."""
    global _shell
    shell = _shell
    if shell is None:
        shell = _shell = get_ipython()
        if shell is None:
            return None
    compiler = getattr(shell, "compile", None)
    numbers = getattr(compiler, "_filename_map", None)  # IPython's {file name: In[N]}
    if isinstance(numbers, dict):
        number = numbers.get(filename)
        if number is None:
            return None
    else:
        number = None
    entry = linecache.cache.get(filename)
    compiled: List[str] = entry[2] if entry is not None and len(entry) == 4 else []
    known = _known.get(filename)
    if known is not None and known[:2] == (number, id(compiled)):
        return known[2], known[3]
    name = getattr(compiler, "format_code_name", lambda _: None)(filename)
    if not name:
        return None
    label = f"{name[0]} {name[1]}"
    text = _raw(shell, number, compiled)
    if text is None:
        text = "".join(compiled)
    _known[filename] = (number, id(compiled), label, text)
    return label, text


def _raw(shell, number: Optional[int], compiled: List[str]) -> Optional[str]:
    """Cell ``number``'s input as typed, if the history holds it and it is the cell that was
    compiled: every compiled line that is not a magic's call is the same line there."""
    history = getattr(getattr(shell, "history_manager", None), "input_hist_raw", None)
    if not isinstance(number, int) or history is None or not 0 < number < len(history):
        return None
    raw = history[number]
    for typed, ran in zip(raw.splitlines(), compiled):
        if "get_ipython()" not in ran and typed.rstrip() != ran.rstrip():
            return None
    return raw if raw.endswith("\n") else raw + "\n"
