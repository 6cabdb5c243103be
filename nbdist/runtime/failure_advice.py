"""What a failed call's error says about the group, besides the ranks' own errors: what happened
to an attached group's other ranks, to ranks left without a process group, and to a group whose
process group can no longer be used -- and what to do next. Text only: :mod:`.calls` decides."""
from __future__ import annotations

from typing import List

from ..errors import ranks_phrase
from ..wire.relay import ABORT_EXIT_CODE


def attached_advice(ended: List[int], rs) -> str:
    """What happened to the other ranks of an attached group, and what to do now."""
    counts = [tuple((r.info or {}).get("restarts") or (0, 0)) for r in rs.ranks]
    done, limit = min(c[0] for c in counts), min(c[1] for c in counts)
    if done < limit:  # torchrun restarts every worker: the group comes back by itself
        told = (f"{ranks_phrase(ended)} {'were' if len(ended) > 1 else 'was'} told to exit (code "
                f"{ABORT_EXIT_CODE}) so that torchrun restarts them all; " if ended else "")
        gen = max(r.generation for r in rs.ranks) + 1
        return (f"{told}torchrun restarts the ranks (restart {done + 1} of {limit}): they join "
                f"this group again as generation {gen}, which your next call waits for and uses; "
                "variables on the ranks are gone (they are new processes)")
    told = (f"{ranks_phrase(ended)} {'were' if len(ended) > 1 else 'was'} told to exit (code "
            f"{ABORT_EXIT_CODE}) so that torchrun/srun ends the job instead of holding the nodes; "
            if ended else "")
    fix = getattr(rs.ranks[0].process, "lost_advice", "") if rs.ranks else ""  # an engine's
    return (f"{told}{fix}" if fix else f"{told}nbdist cannot restart ranks it did not start: call "
            "stop(), then nbdist.attach() again and re-run the launcher command")


def gone_advice(gone: List[int]) -> str:
    """What to say when failed ranks were left without a default process group."""
    if not gone:
        return ""
    return (f"{ranks_phrase(gone)} no longer {'has' if len(gone) == 1 else 'have'} "
            "a default process group: this call destroyed it and did not make a new one, so "
            "collectives fail there until dist.init_process_group runs again on every rank; "
            "restart() (%dist_restart in a notebook) starts fresh ranks.")


def dead_group_advice(call, rs, world_size: int, auto_restart: bool) -> str:
    """What a failed process group means for the group (it is shut down) and what to do."""
    text = ("the process group on the ranks can no longer be used (a collective timed out or "
            "failed), and torch.distributed does not recover from that: the group was shut down; ")
    if rs.ends_survivors:
        text += attached_advice(rs.abort_remote(), rs)
    elif auto_restart:
        text += "it restarts on the next call (auto_restart)"
    else:
        text += ("call restart() (%dist_restart in a notebook) to start fresh ranks (variables "
                 "on the ranks are lost)")
    if len(call.targets) < world_size:
        text += (f". Note: this call ran on {ranks_phrase(call.targets)} only, and a collective "
                 f"on the default group waits for all {world_size} ranks: run it on every rank, "
                 "or on a group of those ranks made with dist.new_group(ranks) (on every rank)")
    return text + "."
