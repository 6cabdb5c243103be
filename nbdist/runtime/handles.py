"""The handle a ``keep_alive`` group leaves for the next kernel: how to reach its ranks again.

A group an engine launched with ``keep_alive=`` saves, once its ranks joined, a small JSON file
(mode 0600: it holds the group key) in Jupyter's runtime directory -- where Jupyter keeps its own
connection files -- named ``nbdist-ENGINE-JOB.json``: the engine, the job, the address the ranks
connect to, the key, the world size and ``keep_alive``. ``nbdist.reattach()`` reads it;
``stop()`` removes it; a handle whose job has ended is removed when found.
"""
from __future__ import annotations

import glob
import json
import os
import re
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple, Union

from ..errors import NbdistError

PREFIX = "nbdist-"  #: handle files are ``nbdist-ENGINE-JOB.json``
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([smhd]?)\s*$")


def keep_alive_seconds(value: Union[str, int, float, None]) -> Optional[float]:
    """``"30m"`` -> 1800.0; seconds (a number) or a number with ``s``/``m``/``h``/``d``;
    ``None`` stays ``None``. :class:`ValueError` saying what is expected on anything else."""
    if value is None:
        return None
    seconds: Optional[float] = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    if seconds is None or not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"keep_alive must be a duration: seconds (e.g. 1800) or a number with s, "
                         f"m, h or d (e.g. '30m', '2h'), more than 0; got {value!r}")
    return seconds


def runtime_dir() -> str:
    """Jupyter's runtime directory (``jupyter --runtime-dir``); without jupyter_core, its usual
    place (``$JUPYTER_RUNTIME_DIR``, else under ``$XDG_DATA_HOME`` or the temp dir)."""
    try:
        from jupyter_core.paths import jupyter_runtime_dir
    except ImportError:
        if os.environ.get("JUPYTER_RUNTIME_DIR"):
            return os.environ["JUPYTER_RUNTIME_DIR"]
        data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                              "share")
        if not os.path.isdir(os.path.dirname(data)):
            data = tempfile.gettempdir()
        return os.path.join(data, "jupyter", "runtime")
    return jupyter_runtime_dir()


def save(handle: Dict[str, Any]) -> str:
    """Write ``handle`` (``engine``, ``job``, ``address``, ``key``...) with mode 0600; its path."""
    folder = runtime_dir()
    os.makedirs(folder, mode=0o700, exist_ok=True)
    name = f"{PREFIX}{handle['engine']}-{re.sub(r'[^A-Za-z0-9_.-]', '_', str(handle['job']))}.json"
    path = os.path.join(folder, name)
    tmp = path + f".{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    if hasattr(os, "fchmod"):
        os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(dict(handle, saved=time.time()), f)
    os.replace(tmp, path)
    return path


def saved() -> List[str]:
    """The handle files here, newest first."""
    paths = glob.glob(os.path.join(runtime_dir(), PREFIX + "*.json"))
    return sorted(paths, key=lambda p: os.path.getmtime(p) if os.path.exists(p) else 0,
                  reverse=True)


def load(job: Optional[str] = None) -> Tuple[str, Dict[str, Any]]:
    """``(path, handle)``: the newest saved handle, or job ``job``'s; :class:`NbdistError` saying
    what to do when there is none."""
    paths = saved()
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                handle = json.load(f)
        except (OSError, ValueError):
            continue
        if job is None or str(handle.get("job")) == str(job):
            return path, handle
    which = f"for job {job!r} " if job is not None else ""
    others = (f" (there are handles for other jobs: "
              f"{', '.join(os.path.basename(p) for p in paths)})") if paths else ""
    raise NbdistError(f"reattach(): no saved nbdist group {which}in {runtime_dir()}{others}. A "
                      "group leaves one there when it is started with keep_alive, e.g. "
                      "nbdist.start(2, on='slurm', keep_alive='30m'); start one that way, then "
                      "nbdist.reattach() in the next kernel finds it.")


def remove(path: Optional[str]) -> None:
    """Remove a handle file (nothing if it is gone already)."""
    if path:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
