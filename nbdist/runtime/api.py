"""The runtime's front functions: start a group, attach one, run once, stop everything."""
from __future__ import annotations

import atexit
import sys
from typing import Any, Callable, List, Optional

from ..errors import NbdistError
from . import group as group_module
from .attach import AttachLauncher, parse_listen
from .group import Group
from .launcher import LocalLauncher


def start(world_size: int = 2, backend: Optional[str] = "auto", device: Optional[str] = "auto",
          timeout: float = 60.0, *, on: str = "local", start_method: Optional[str] = None,
          protect: Optional[bool] = None, **options) -> Group:
    """Start a :class:`Group` of ``world_size`` ranks and return it once torch.distributed is ready.

    See :class:`Group` for the options. Use it as a context manager to stop it at the end.
    ``start_method`` is how the worker processes start: ``"forkserver"`` (the default where the OS
    has it: Linux, macOS; torch is imported once, in the server) or ``"spawn"`` (the only one on
    Windows; each rank imports torch itself, a few seconds more per start, nothing inherited from
    the server). ``None`` takes the ``NBDIST_START_METHOD`` environment variable if set. Restarts
    keep the method. ``protect=True`` signs every message as :func:`attach` does on a network (a
    local group talks over loopback only, so it is off by default).

    ``on``: where the ranks run. ``"local"`` (the default): this machine. Another name is an
    engine that places them (``"slurm"``: :func:`nbdist.slurm.start <nbdist.engines.slurm.start>`;
    third-party engines register under the entry-point group ``nbdist.engines``), and the options
    it takes (``nodes=``, ``partition=``...) go to it; its ranks run the same worker as every
    group's.
    """
    if on != "local":
        from .engines import start_on

        for name, value in (("start_method", start_method), ("protect", protect)):
            if value is not None:
                options[name] = value
        return start_on(on, world_size, backend, device, timeout, options)
    if "keep_alive" in options:
        raise ValueError("keep_alive is for groups an engine launched (on='slurm'): the ranks of a "
                         "local group are this kernel's own processes and end with it. Drop "
                         "keep_alive, or start the group with on='slurm'.")
    return Group(world_size, backend, device, timeout,
                 _launcher=LocalLauncher(start_method, protect=bool(protect)), **options)


def attach(world_size: int, listen: str = "127.0.0.1:0", backend: Optional[str] = "auto",
           device: Optional[str] = "auto", timeout: float = 60.0, *, key_file: Optional[str] = None,
           join_timeout: float = 600.0, nproc_per_node: Optional[int] = None,
           progress: bool = True, protect: Optional[bool] = None, **options) -> Group:
    """Open a group whose ``world_size`` ranks run elsewhere, started by torchrun or srun.

    The notebook listens on ``listen`` (``"HOST:PORT"``; an address you choose, never all
    interfaces), writes the group key to ``key_file`` (a new private temp file by default), prints
    the ``torchrun ... -m nbdist.worker --connect HOST:PORT --key-file FILE`` and ``srun`` commands,
    and returns once every rank has joined and initialised torch.distributed (or raises
    :class:`DistTimeoutError` after ``join_timeout`` seconds naming the missing ranks). Each rank
    takes its rank and world size from the launcher's environment. ``backend="auto"`` is resolved
    on the ranks' own hardware. The returned group works like a local one, except ``restart()``;
    ranks that torchrun restarts (``--max-restarts``) re-join it as its next generation. When a
    rank is lost the group tells the other ranks to exit, so the launcher's job ends too.

    ``protect``: sign every message after the handshake (HMAC-SHA256 with per-connection keys and
    sequence numbers; a tampered message is refused and its connection dropped). ``None`` (the
    default) protects unless ``listen`` is a loopback address; ``True`` forces it on loopback too;
    ``False`` turns it off, for a network you trust. It gives integrity, not secrecy: see
    docs/multinode.md. The ranks learn the choice from the controller's authenticated handshake.
    """
    launcher = AttachLauncher(parse_listen(listen), key_file, join_timeout, nproc_per_node,
                              progress, protect)
    return Group(world_size, backend, device, timeout, _launcher=launcher, **options)


def launch(fn: Callable, *args, world_size: int = 2, backend: Optional[str] = "auto",
           device: Optional[str] = "auto", **kwargs) -> List[Any]:
    """One shot: start a group, run ``fn(*args, **kwargs)`` on every rank, stop; return results."""
    with Group(world_size, backend, device) as group:
        return group.run(fn, *args, **kwargs)


def stop_all() -> None:
    """Stop every group still running in this process (also at interpreter exit, but for groups
    started with ``keep_alive``, left for :func:`nbdist.reattach`), each
    within about 5 s whatever its ranks do; what a stop could not do is said on stderr (it does
    not stop the others)."""
    _stop_groups(list(group_module._live))


def _stop_groups(groups) -> None:
    for group in groups:
        try:
            group.stop(timeout=5.0)
        except NbdistError as err:  # left something behind: said, and the others still stopped
            sys.stderr.write(f"nbdist: stopping group {group.id}: {type(err).__name__}: {err}\n")
            sys.stderr.flush()


def stop_for_exit() -> None:
    """At interpreter exit: stop every group, except those started with ``keep_alive``, whose
    ranks wait for :func:`nbdist.reattach` in a new kernel."""
    stopping = []
    for group in list(group_module._live):
        kept = getattr(group._launcher, "keep_alive", None)
        if kept and group.state != "stopped":
            sys.stderr.write(f"nbdist: group {group.id} keeps its ranks for {kept:g} s "
                             "(keep_alive): nbdist.reattach() in a new kernel reconnects.\n")
        else:
            stopping.append(group)
    _stop_groups(stopping)


atexit.register(stop_for_exit)
