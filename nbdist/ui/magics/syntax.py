"""Code for ``%%dist`` / ``%dist``, compiled in the kernel before anything is sent.

A cell that does not compile shows as IPython shows a SyntaxError in a local cell: where in the
cell (``Cell In[5], line 3``), the line, a caret, the message -- and no frames of nbdist or
IPython (:class:`CellSyntaxError`). In the one-line form, options typed after the statement
(``%dist print(rank) --ranks 1``) are refused with the line written the right way round.
Options are never taken from the end of a statement that compiles: ``x = a --rank`` is Python
(``a - (-rank)``), and it runs as written.
"""
from __future__ import annotations

import sys
import traceback
import warnings
from typing import List, Optional, Tuple

from IPython.core.error import UsageError

from .base import usage

_MAGIC_CALLS = ("run_cell_magic", "run_line_magic")


class CellSyntaxError(Exception):
    """``%%dist`` code that does not compile; nothing was sent to the ranks.

    In a notebook it shows as a SyntaxError in a local cell does: where in the cell, the line, a
    caret and the message. ``error`` (also ``__cause__``) is the ``SyntaxError``, its ``lineno``
    counted in the notebook cell when the cell is known.
    """

    def __init__(self, error: SyntaxError, where: str):
        self.error, self.where = error, where
        super().__init__(f"{error.msg} ({where}, line {error.lineno})")

    def _render_traceback_(self) -> List[str]:
        # IPython shows these lines instead of a traceback (as for nbdist's own errors)
        lines = "".join(traceback.format_exception_only(SyntaxError, self.error)).splitlines()
        if lines and lines[0].lstrip().startswith("File "):
            lines = lines[1:]
        return [f"  {self.where}, line {self.error.lineno}"] + lines


def check_cell(shell, source: str, from_autodist: bool) -> None:
    """Raise :class:`CellSyntaxError` if a ``%%dist`` cell's code does not compile.
    ``from_autodist``: ``%autodist`` added the ``%%dist`` line (the code starts on line 1)."""
    error = _compile_error(source)
    if error is not None:
        where, line = _position(shell)  # the %%dist line is the cell's first, unless autodist
        _raise(error, where or "%%dist cell", 0 if where is None else line - from_autodist)


def check_statement(shell, magic, statement: str) -> None:
    """Raise ``UsageError`` if the statement of ``%dist statement`` ends in the magic's options
    (they go before it), :class:`CellSyntaxError` if it does not compile otherwise."""
    error = _compile_error(statement)
    if error is None:
        return
    moved = _options_after(magic, statement)
    if moved is not None:
        code, options = moved
        raise UsageError(f"options go before the statement: %dist {options} {code}\n(what "
                         f"follows the statement, {options!r}, was read as Python code and does "
                         f"not compile)\n{usage(magic)}")
    where, line = _position(shell)
    _raise(error, where or "%dist statement", 0 if where is None else line - 1)


def _compile_error(source: str) -> Optional[SyntaxError]:
    with warnings.catch_warnings():  # the ranks compile it again and warn there
        warnings.simplefilter("ignore")
        try:
            compile(source, "<dist>", "exec")
        except SyntaxError as err:
            return err
    return None


def _options_after(magic, statement: str) -> Optional[Tuple[str, str]]:
    """``(code, options)`` if the statement is code that compiles followed by options that the
    magic's parser accepts; ``None`` otherwise."""
    words = statement.split(" ")
    for i in range(1, len(words)):
        if not words[i].startswith("-"):
            continue
        code, options = " ".join(words[:i]).rstrip(), " ".join(words[i:]).strip()
        if _compile_error(code) is not None:
            continue
        try:
            magic.parser.parse_argstring(options)
        except UsageError:
            continue
        return code, options
    return None


def _position(shell) -> Tuple[Optional[str], int]:
    """(``"Cell In[5]"``, the cell's line of the magic) for a magic that a notebook cell ran;
    (``None``, 0) if it was called some other way (from a function, say)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in _MAGIC_CALLS and \
                frame.f_globals.get("__name__") == "IPython.core.interactiveshell":
            caller = frame.f_back
            name = getattr(shell.compile, "format_code_name", lambda _: None)(
                caller.f_code.co_filename) if caller is not None else None
            return (f"{name[0]} {name[1]}", caller.f_lineno) if name else (None, 0)
        frame = frame.f_back
    return None, 0


def _raise(error: SyntaxError, where: str, offset: int) -> None:
    if error.lineno is not None:
        error.lineno += offset
    if getattr(error, "end_lineno", None) is not None:
        error.end_lineno += offset
    raise CellSyntaxError(error, where) from error
