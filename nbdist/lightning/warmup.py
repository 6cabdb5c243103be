"""Lightning imported on the ranks before the first fit: :func:`warm`, and the notebook's trigger.

Importing Lightning takes about 2.5 s on a rank here, and the first :func:`nbdist.lightning.fit`
on a group used to pay it while the user waited (later fits take a few hundredths of a second).
:func:`warm` has every rank import it as soon as it is idle (:meth:`nbdist.Group.preload`) and
returns at once; a call that reaches the ranks meanwhile starts when the import is done, so the
first call after the kernel imported Lightning may wait for the rest of it, once. In a notebook with ``%load_ext nbdist`` it
happens by itself (:func:`warm_groups`): before a cell that imports Lightning (``import lightning``,
``from pytorch_lightning import ...``; a regular expression on the cell's text), so the ranks
import it while the kernel does, and after each cell if the kernel has imported it some other way
(``lightning`` or ``pytorch_lightning`` in ``sys.modules``: a dictionary lookup, nothing
imported). Only idle groups are warmed, each once per start. A kernel that never
imports Lightning never warms anything, so groups that don't use it pay nothing; set
:data:`AUTO` to ``False`` to turn the trigger off.
"""
from __future__ import annotations

import re
import sys
from typing import List, Optional

from ..runtime.current import _live
from .guards import _installed_namespace

AUTO = True  #: warm groups by themselves once the kernel has imported Lightning (notebook only)
_IMPORT = re.compile(r"^[ \t]*(?:import|from)[ \t]+(lightning|pytorch_lightning)\b", re.M)


def warm(group) -> bool:
    """Have every rank of ``group`` import Lightning as soon as it is idle; return at once.

    ``True`` once the import is under way or done there; ``False`` while the group is busy (a
    running job) or not ready -- try again later. :func:`fit` works either way.
    """
    return group.preload(_installed_namespace())


def warm_groups(source: Optional[str] = None) -> List:
    """:func:`warm` every idle group if the kernel has imported Lightning, or -- given the
    ``source`` of a cell about to run -- if that cell imports it (then the ranks import it while
    the kernel does). The IPython extension calls this before and after each cell; a group warmed
    already costs nothing (no call). Returns the groups where the import is done or queued."""
    if not AUTO:
        return []
    if source is not None:
        found = None if source.lstrip().startswith("%%") else _IMPORT.search(source)
        if found is None:  # a %%dist cell imports on the ranks itself
            return []
        name = "pytorch_lightning" if found.group(1) == "pytorch_lightning" else "lightning.pytorch"
    elif "lightning" in sys.modules or "pytorch_lightning" in sys.modules:
        name = _installed_namespace()
    else:
        return []
    return [g for g in list(_live) if g.state == "ready" and g.preload(name)]
