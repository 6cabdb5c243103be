"""What the panels say about a strategy's device mesh: dropdown labels such as
``fsdp2+tp (dp 2 x tp 2)`` and the note under the choice, from
:func:`nbdist.strategies.mesh_sizes` (where the defaults live)."""
from __future__ import annotations

import html
from typing import Dict, List, Optional, Tuple


def sizes_text(sizes: Dict[str, int]) -> str:
    """``{"dp": 2, "tp": 2}`` -> ``"dp 2 x tp 2"``."""
    return " x ".join(f"{d} {s}" for d, s in sizes.items())


def strategy_mesh(name: str, world_size: int) -> Optional[Dict[str, int]]:
    """The mesh ``name`` builds on ``world_size`` ranks with its default options, or ``None``."""
    from ...strategies import mesh_sizes

    return mesh_sizes(name, world_size)


def strategy_options(world_size: int) -> List[Tuple[str, str]]:
    """Dropdown options ``(label, name)`` for every registered strategy: a mesh strategy's label
    carries its sizes on ``world_size`` ranks, e.g. ``("hsdp (dp_replicate 2 x dp_shard 2)",
    "hsdp")``; the value stays the plain name."""
    from ...strategies import available_strategies

    options = []
    for name in available_strategies():
        sizes = strategy_mesh(name, world_size)
        options.append((f"{name} ({sizes_text(sizes)})" if sizes else name, name))
    return options


def mesh_note(name: str, world_size: int) -> str:
    """HTML for the note under the strategy: its mesh on ``world_size`` ranks, and what a size-1
    dimension means (``fsdp2+tp`` on an odd world is tensor parallel alone); ``""`` without one."""
    sizes = strategy_mesh(name, world_size)
    if sizes is None:
        return ""
    args = ", ".join(f"{d}={s}" for d, s in sizes.items())
    text = (f"mesh on {world_size} ranks: <b>{html.escape(sizes_text(sizes))}</b> (the default "
            f"sizes, <code>nbdist.strategies.mesh_sizes</code>; the picture: "
            f"<code>nbdist.ui.mesh_panel({world_size}, {html.escape(args)})</code> or "
            f"<code>%dist_ui mesh</code>)")
    ones = [d for d, s in sizes.items() if s == 1]
    if ones and len(sizes) > 1:
        text += (f". {' and '.join(ones)} of size 1: nothing is split along it on {world_size} "
                 "ranks (an even world of 4 or more gives both dimensions several ranks)")
    return f"<div class='nbdist-mesh-note' style='font-size:smaller;color:#444'>{text}</div>"
