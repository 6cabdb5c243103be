"""What every nbdist magic shares: the current group, argument parsing, usage text, registration."""
from __future__ import annotations

import argparse
import math
import re
import weakref
from typing import List, Optional, Sequence, Tuple

from IPython.core.error import UsageError
from IPython.core.getipython import get_ipython
from IPython.core.magic import Magics
from IPython.utils.process import arg_split
from IPython.display import display

from ...report.units import dashed_values, parse_sizes
from ...runtime.group import Group, current_group
from ...runtime.jobs import STARTED
from ...runtime.status import MIN_TIMEOUT, TOO_SHORT
from ...runtime.requests import is_variable_name, keyword_note

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


# argparse ``type=`` converters: a wrong value raises ArgumentTypeError, which argparse reports as
# "argument --OPTION: <message>": say what is expected, with an example, and what was given.
def _resource(text: str):
    """``"TPU=1"`` -> ``("TPU", 1.0)``: one ``--resource`` of ``%dist_start --on ray``."""
    name, sep, value = text.partition("=")
    try:
        return name.strip(), float(value) if sep and name.strip() else float("x")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER (e.g. TPU=1), got {text!r}") \
            from None


def _positive(kind):
    """A positive ``int``: ``"0"``, ``"-1"``, ``"1.5"`` and ``"x"`` are refused."""
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


def _at_least_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int of at least 0, got {text!r}")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (``nan`` and ``inf`` are no deadline)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of seconds, e.g. 30; got {text!r}")
    return value


def _start_seconds(option: str):
    """``--timeout`` / ``--init-timeout`` of ``%dist_start`` and ``%dist_restart`` (``option``:
    ``timeout`` / ``init_timeout``): seconds, at least the runtime's shortest (checked here, so a
    restart never stops a working group for it)."""
    def convert(text: str) -> float:
        value = _seconds(text)
        if value < MIN_TIMEOUT:
            raise argparse.ArgumentTypeError(f"expected at least {MIN_TIMEOUT:g} s "
                                             f"({TOO_SHORT[option]}), e.g. 60; got {text!r}")
        return value

    convert.__name__ = "seconds"
    return convert


#: how the advice of start() and restart() names their options while a magic runs them
START_OPTIONS = {"debug": "--debug LEVEL", "init_timeout": "--init-timeout S",
                 "max_world_size": "--max-world-size N", "threads": "--threads N",
                 "timeout": "--timeout S"}


def _rank(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a rank number, e.g. 0; got {text!r}")
    return value


def _rank_list(text: str) -> List[int]:
    try:
        ranks = [int(part) for part in text.split(",")]
    except ValueError:
        ranks = [-1]
    if min(ranks) < 0:
        raise argparse.ArgumentTypeError(
            f"expected rank numbers separated by commas, e.g. 0,2; got {text!r}")
    return ranks


def _sizes(text: str) -> List[int]:
    """``--sizes``: message sizes in bytes (``4K-64M``, ``1K,1M``), as :func:`parse_sizes` reads."""
    try:
        return parse_sizes(text)
    except (ValueError, TypeError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _world_sizes(text: str) -> List[int]:
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = [0]
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(
            f"expected world sizes separated by commas, e.g. 8,64,512; got {text!r}")
    return sizes


def _strategy_list(text: str) -> List[str]:
    from ...strategies import get_strategy

    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"expected strategy names separated by commas, e.g. ddp,zero1,fsdp; got {text!r}")
    for name in names:
        if "=" in name or ":" in name:
            raise argparse.ArgumentTypeError(
                f"--strategies takes strategy names only, got {name!r}: the mesh strategies use "
                "their default sizes here (nbdist.strategies.mesh_sizes); for other sizes call "
                "nbdist.memory.measure(group, model_fn, ['fsdp2+tp'], options={'fsdp2+tp': "
                "{'tp': 2}})")
        try:
            get_strategy(name)
        except ValueError as err:  # names the valid ones
            raise argparse.ArgumentTypeError(str(err)) from None
    return names


JOBS = STARTED  #: the jobs started in this kernel, oldest first (``%%dist --bg``, ``g.submit``...)


def job_name(text: str) -> str:
    """``--bg NAME``: a variable name, not a keyword (the job is also stored in that variable);
    plain ``--bg`` gives ``""``: no variable."""
    if text and not is_variable_name(text):
        why = " (a Python keyword: no code could use a variable of that name)" \
            if keyword_note(text) else ""
        raise argparse.ArgumentTypeError(f"expected a variable name for the job, e.g. train; "
                                         f"got {text!r}{why}")
    return text


def check_ranks(ranks: Optional[Sequence[int]], world_size: int, option: str, magic) -> None:
    """``UsageError`` naming ``option`` if a rank is not in ``0..world_size-1``."""
    bad = sorted({r for r in ranks or () if r >= world_size})
    if bad:
        raise UsageError(f"{option} {','.join(map(str, bad))}: the group has ranks "
                         f"0..{world_size - 1}\n{usage(magic)}")


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
            return magic.parser.parse_args(dashed_values(magic.parser, arg_split(line)))
        except UsageError as err:
            raise UsageError(f"{err}\n{usage(magic)}") from None


class _OptionsError(Exception):
    """The options before a statement are wrong; the magic's own parser says how."""


class _StatementSplitter(argparse.ArgumentParser):
    """A magic's options (copied from its parser), then the statement: everything from the first
    word argparse does not take as an option or an option's value."""

    def __init__(self, magic):
        super().__init__(parents=[magic.parser], add_help=False,
                         allow_abbrev=magic.parser.allow_abbrev)
        self.add_argument("statement", nargs=argparse.REMAINDER)

    def error(self, message):
        raise _OptionsError(message)


def split_statement(magic, line: str) -> Tuple[str, str]:
    """``--ranks 0 --quiet x = 1`` -> (``"--ranks 0 --quiet"``, ``"x = 1"``), for a line magic
    whose parser has options only; the statement keeps its text as typed.

    Where the options end is argparse's decision, made with the magic's own parser, so an option
    added to the magic is known here too. ``--`` ends the options; a word that starts with one dash
    and is no option (``-x``) starts the statement; an unknown ``--word`` stays with the options
    and is reported by the magic's parser. If the options are wrong, the whole line is returned as
    options, for the magic's parser to say what is wrong.
    """
    words = list(re.finditer(r"\S+", line))
    tokens = [w.group() for w in words]
    try:
        known, unknown = _StatementSplitter(magic).parse_known_args(tokens)
    except _OptionsError:
        return line.strip(), ""
    start = len(tokens) - len(known.statement)
    loose = [t for t in unknown if not t.startswith("--")]  # "-x": an expression, no option
    if loose:
        start = min(start, tokens.index(loose[0]))
    options = tokens[:start]
    if start < len(tokens) and tokens[start] == "--":  # argparse keeps it in the statement
        start += 1
    elif options and options[-1] == "--":  # or drops it (newer Pythons)
        options.pop()
    statement = line[words[start].start():].strip() if start < len(tokens) else ""
    return " ".join(options), statement


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
