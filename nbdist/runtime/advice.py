"""How nbdist's advice names the options a caller can change.

A message that says what to change ("pass max_world_size= to raise the limit") names the option
as the caller wrote the call: the keyword of :func:`nbdist.start` by default, the magic's own
option (``--max-world-size N``) while a magic such as ``%dist_start`` runs (it sets the names
with :func:`option_names`). The names live in a context variable: each thread, and each call of a
magic, sees its own.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Dict, Iterator, Optional

_names: "contextvars.ContextVar[Optional[Dict[str, str]]]" = contextvars.ContextVar(
    "nbdist_option_names", default=None)


def option(keyword: str) -> str:
    """How advice names the start option ``keyword``: ``"init_timeout="``, or what the running
    magic takes instead (``"--init-timeout S"``)."""
    return (_names.get() or {}).get(keyword, f"{keyword}=")


@contextlib.contextmanager
def option_names(names: Dict[str, str]) -> Iterator[None]:
    """Within the block, advice names the options ``names`` maps (keyword -> the caller's own
    option, e.g. ``{"init_timeout": "--init-timeout S"}``)."""
    token = _names.set(dict(names))
    try:
        yield
    finally:
        _names.reset(token)
