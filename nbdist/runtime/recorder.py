"""A light recorder of each rank's collectives, on by default: the last :data:`KEEP` calls of
``torch.distributed``'s collective functions -- op, its number on its process group, the group,
the input's shape and dtype, when it was issued and when it returned. Where a call or a job stalls,
the notebook compares the ranks' records and names what differs (:func:`analyse`): "ranks 0, 2, 3
are in all_reduce #18 (1024 float32); rank 1 is in broadcast #18 (10 float32)", or "rank 3 never
reached collective #18 on the default group".

On a rank, :func:`install` wraps the functions of ``torch.distributed`` (module attributes, so code
that calls ``dist.all_reduce`` -- FSDP, DeepSpeed and Lightning included -- goes through them; a
name imported before the rank started does not). A collective issued with ``async_op=True`` counts
as returned when its ``Work`` is handed back. Collectives torch issues from C++ (DDP's gradient
buckets) are not seen. ``NBDIST_RECORD=0`` in the group's environment turns the recorder off. The
records travel with the stacks (:mod:`.stacks`); the cost is measured in
``benchmarks/bench_recorder.py``.
"""
from __future__ import annotations

import collections
import functools
import os
import time
from typing import Any, Dict, List, Optional

from ..errors import ranks_phrase

ENV_VAR = "NBDIST_RECORD"  #: ``0`` turns the recorder off on the ranks
KEEP = 64  #: collectives kept per rank
#: the collectives recorded. Not ``isend`` / ``irecv``: ``dist.P2POp`` (pipelines'
#: ``batch_isend_irecv``) accepts only torch's own functions, by identity.
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
       "all_gather_object", "gather", "gather_object", "scatter", "scatter_object_list",
       "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
       "broadcast_object_list", "send", "recv", "monitored_barrier")

RAISED = "raised"  #: an 8th field of a record whose collective raised
_records: "collections.deque[list]" = collections.deque(maxlen=KEEP)
_counts: Dict[Any, int] = {}
_names: Dict[int, str] = {}


def install(dist) -> bool:
    """Wrap ``dist``'s collectives (once); False when ``NBDIST_RECORD=0`` said not to."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return False
    tensor_type = __import__("torch").Tensor
    group_type = dist.ProcessGroup
    for op in OPS:
        fn = getattr(dist, op, None)
        if fn is not None and not getattr(fn, "_nbdist_recorded", False):
            setattr(dist, op, _wrap(op, fn, tensor_type, group_type))
    return True


def _wrap(op: str, fn, tensor_type, group_type):
    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        group, shape, dtype = kwargs.get("group"), None, None
        for a in args:
            if isinstance(a, tensor_type):
                shape, dtype = a.shape, a.dtype
            elif group is None and isinstance(a, group_type):
                group = a
        name = "default" if group is None else _names.get(id(group)) or _name(group)
        seq = _counts[name] = _counts.get(name, 0) + 1
        entry = [seq, op, name, tuple(shape) if shape is not None else None,
                 str(dtype).replace("torch.", "") if dtype is not None else None,
                 time.time(), None]
        _records.append(entry)
        try:
            return fn(*args, **kwargs)
        except BaseException:
            entry.append(RAISED)  # the failure came out of this collective (:func:`raised`)
            raise
        finally:
            entry[6] = time.time()
    recorded._nbdist_recorded = True
    return recorded


def _name(group) -> str:
    name = _names[id(group)] = f"group {len(_names) + 1}"
    return name


def snapshot() -> List[list]:
    """The records kept, oldest first: ``[seq, op, group, shape, dtype, issued, returned]``
    (``returned`` is ``None`` while the collective runs). Taken on the watchdog's side while the
    main thread records collectives: the deque is copied first, in one C call no other thread
    can cut (iterating it from Python while a collective is appended raises RuntimeError)."""
    return [list(e) for e in _records.copy()]


def raised() -> Optional[list]:
    """The newest record, if its collective raised (a failure then came out of it)."""
    return list(_records[-1]) if _records and len(_records[-1]) > 7 else None


# ---- on the notebook's side ---------------------------------------------------------------------
def _what(entry: list) -> str:
    seq, op, group, shape, dtype = entry[:5]
    size = "" if shape is None else \
        f" ({'x'.join(map(str, shape)) or 'scalar'}{' ' + dtype if dtype else ''})"
    where = "" if group == "default" else f" on {group}"
    return f"{op} #{seq}{where}{size}"


def failed_in(records: Dict[int, Optional[list]]) -> str:
    """What the ranks that failed were doing, from each one's :func:`raised` record: the
    collective each raised in, and whether they differ. ``""`` when none raised in one."""
    inside = {r: e for r, e in sorted(records.items()) if e is not None}
    if not inside:
        return ""
    kinds: Dict[str, List[int]] = {}
    for r, e in inside.items():
        kinds.setdefault(_what(e), []).append(r)
    parts = "; ".join(f"{ranks_phrase(rs)} failed in {what}" for what, rs in kinds.items())
    if len(kinds) > 1:
        return f"Mismatched collectives: {parts}."
    return f"{parts[0].upper()}{parts[1:]}."


def analyse(records: Dict[int, Optional[List[list]]], places: Dict[int, str]) -> List[str]:
    """What the ranks' records say about a stall, in sentences (``[]``: no collective running).
    ``records``: each rank's :func:`snapshot` (``None``: no answer); ``places``: where each rank
    is (the last frame of its stack), for the ranks that are in no collective."""
    running = {r: next((e for e in reversed(rec) if e[6] is None), None)
               for r, rec in records.items() if rec is not None}
    inside = {r: e for r, e in running.items() if e is not None}
    if not inside:
        return []
    kinds: Dict[str, List[int]] = {}
    for r, e in sorted(inside.items()):
        kinds.setdefault(_what(e), []).append(r)
    lines = []
    if len(kinds) > 1:
        parts = [f"{ranks_phrase(rs)} {'are' if len(rs) > 1 else 'is'} in {what}"
                 for what, rs in kinds.items()]
        lines.append("mismatched collectives: " + "; ".join(parts) + ".")
    groups = {e[2]: max(x[0] for x in inside.values() if x[2] == e[2]) for e in inside.values()}
    missing = []
    for r in sorted(set(running) - set(inside)):
        rec = records[r]
        for group, seq in groups.items():
            done = max((e[0] for e in rec if e[2] == group), default=0)
            if done < seq:
                where = f"; it is at {places[r]}" if places.get(r) else ""
                on = "" if group == "default" else f" on {group}"
                last = f"its last was #{done}" if done else "none before it"
                missing.append(f"rank {r} never reached collective #{seq}{on} "
                               f"({last}){where}.")
    if len(kinds) == 1 and not missing and len(inside) == len(records):
        ((what, rs),) = kinds.items()
        lines.append(f"{ranks_phrase(rs)} {'are all' if len(rs) > 1 else 'is'} in {what}: the "
                     "collective itself has not completed (a slow or lost peer, or the network).")
    return lines + missing
