"""What every nbdist magic shares: the current group, argument parsing, usage text, registration."""
from __future__ import annotations

import argparse
import contextlib
import html
import re
import weakref
from typing import Iterator, List, Optional, Sequence

from IPython.core.error import UsageError
from IPython.core.getipython import get_ipython
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import publish_display_data

from ...runtime.group import Group, current_group, start, use_group

_started: "weakref.WeakSet[Group]" = weakref.WeakSet()  # %unload_ext nbdist stops these
_magic_classes: List[type] = []


def register_magics(cls: type) -> type:
    """Class decorator: load this ``Magics`` subclass with ``%load_ext nbdist``."""
    names = [c.__name__ for c in _magic_classes]
    if cls.__name__ in names:
        raise ValueError(f"a magics class named {cls.__name__!r} is already registered "
                         f"(registered: {', '.join(names)}); give the class another name.")
    _magic_classes.append(cls)
    shell = get_ipython()
    if shell is not None and _is_loaded(shell):
        shell.register_magics(cls)
    return cls


def _is_loaded(shell) -> bool:
    return any(isinstance(m, NbdistMagics) for m in shell.magics_manager.registry.values())


def _positive(kind):
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text!r}")
        return value

    convert.__name__ = kind.__name__
    return convert


def _rank_list(text: str) -> List[int]:
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        ranks = [-1]
    if min(ranks) < 0:
        raise argparse.ArgumentTypeError(
            f"expected rank numbers separated by commas, e.g. 0,2; got {text!r}")
    return ranks


class NbdistMagics(Magics):
    """Base class of nbdist's magics: the current group and argument parsing."""

    @property
    def group(self) -> Group:
        """The current group; ``UsageError`` if there is none."""
        if current_group() is None:
            raise UsageError("no nbdist group is running: start one with %dist_start -n 2, or "
                             "attach one started in code with nbdist.ui.magics.use_group(g).")
        return current_group()

    def parse(self, magic, line: str) -> argparse.Namespace:
        """Parse ``line`` for ``magic``; a mistake raises ``UsageError`` ending in the usage."""
        try:
            return parse_argstring(magic, line)
        except UsageError as err:
            raise UsageError(f"{err}\n{usage(magic)}") from None


def usage(magic) -> str:
    """The one-line usage of a magic: ``usage: %dist [--ranks R[,R...]] ...``."""
    return "usage: " + " ".join(magic.parser.format_usage().replace("::", "").split())


def _show_figure(drawn) -> None:
    """Show a figure inline as a PNG (works in any frontend, inline backend or not), then close it."""
    import io

    import matplotlib.pyplot as plt
    from IPython.display import Image

    while not hasattr(drawn, "savefig") and not hasattr(drawn, "figure"):
        drawn = list(drawn)[0]  # several Axes side by side (a tuple or an array)
    fig = drawn if hasattr(drawn, "savefig") else drawn.figure  # a Figure, or an Axes
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    display(Image(data=buf.getvalue(), format="png"))
