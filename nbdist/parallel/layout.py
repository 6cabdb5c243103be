"""Where each rank sits in a device mesh, from sizes alone: no process group, no torch needed.

torch's ``init_device_mesh(device, shape)`` lays the ranks out row-major: the mesh is
``arange(world).reshape(shape)``, so the last dimension is the innermost (ranks next to each other
share a ``tp`` group; a ``dp`` group strides across them). :class:`MeshLayout` computes the same
layout in the kernel, prints it as a small grid, and draws it (``.plot()``).
"""
from __future__ import annotations

import html
import itertools
from typing import Dict, List, Optional, Sequence, Tuple

#: The mesh dimensions nbdist knows, outermost first. Tensor parallel is innermost (its ranks
#: exchange the most, so they are neighbours: one node, one fast link); pipeline stages outermost.
DIMS = ("pp", "dp", "dp_replicate", "dp_shard", "tp")
_SHOWN = 12  # factorizations listed in an error


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"mesh size {name}={value!r} must be a positive int, or -1 for the "
                         "ranks left over by the other sizes")


def factorizations(world_size: int, dims: Sequence[str] = ("dp", "tp")) -> List[Dict[str, int]]:
    """Every way to split ``world_size`` ranks over ``dims`` (sizes >= 1 whose product is the world).

    ``factorizations(4)`` -> ``[{"dp": 4}, {"dp": 2, "tp": 2}, {"tp": 4}, ...]`` with size-1
    dimensions left out of each dict (the whole world on one dimension comes first).
    """
    out = []
    for sizes in itertools.product(range(1, world_size + 1), repeat=len(dims)):
        prod = 1
        for s in sizes:
            prod *= s
        if prod == world_size:
            out.append({d: s for d, s in zip(dims, sizes) if s > 1} or {dims[0]: 1})
    out.sort(key=lambda f: [-f.get(d, 1) for d in dims])
    return out


def _format(sizes: Dict[str, int]) -> str:
    return ", ".join(f"{d}={s}" for d, s in sizes.items())


def resolve_sizes(world_size: int, **sizes: Optional[int]) -> Dict[str, int]:
    """The named mesh sizes, in :data:`DIMS` order, checked against ``world_size``.

    ``None`` leaves a dimension out; ``-1`` (at most one) takes the ranks the others leave; with no
    size given at all the whole world is ``dp``. A dimension the caller names is kept even at size
    1, so ``mesh["tp"]`` exists whatever its size.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    unknown = [d for d in sizes if d not in DIMS]
    if unknown:
        raise ValueError(f"unknown mesh dimension {unknown[0]!r}; nbdist's mesh dimensions are "
                         f"{', '.join(DIMS)}")
    given = {d: sizes[d] for d in DIMS if sizes.get(d) is not None}
    for name, value in given.items():
        _positive(name, value)
    if "dp" in given and ({"dp_replicate", "dp_shard"} & set(given)):
        raise ValueError("give dp (one data-parallel dimension) or dp_replicate and dp_shard "
                         "(HSDP: replicas of sharded groups), not both")
    if not given:
        return {"dp": world_size}
    rest = [d for d, s in given.items() if s == -1]
    if len(rest) > 1:
        raise ValueError(f"only one mesh size may be -1 (the ranks left over), got -1 for "
                         f"{' and '.join(rest)}")
    known = 1
    for d, s in given.items():
        if s != -1:
            known *= s
    if rest and world_size % known == 0:
        given[rest[0]] = world_size // known
    elif not rest and known == world_size:
        pass
    else:
        dims = list(given)
        if not {"dp", "dp_replicate", "dp_shard"} & set(dims):
            dims = [d for d in DIMS if d in dims or d == "dp"]
        valid = factorizations(world_size, dims)
        shown = "; ".join(_format(f) for f in valid[:_SHOWN]) + ("; ..." if len(valid) > _SHOWN
                                                                 else "")
        why = (f"the other sizes multiply to {known}, which does not divide {world_size}"
               if rest else f"their product is {known}")
        raise ValueError(f"mesh sizes {_format(given)} do not fit {world_size} ranks: the sizes "
                         f"must multiply to the world size ({why}). Valid for {world_size} ranks "
                         f"over {', '.join(dims)}: {shown} (-1 takes the ranks left over, "
                         f"e.g. {dims[0]}=-1)")
    return given


class MeshLayout:
    """Which rank sits where in a mesh of ``world_size`` ranks: ``MeshLayout(4, dp=2, tp=2)``.

    The same row-major layout torch's ``init_device_mesh`` uses (the last dimension innermost),
    computed from sizes alone, so it works in the kernel before any rank exists. ``str()`` is a
    text grid, a notebook shows an HTML one, ``plot()`` draws it (needs matplotlib).
    :func:`nbdist.parallel.device_mesh` builds the torch mesh with exactly this layout.

    Sizes as in :func:`nbdist.parallel.device_mesh`: ``None`` leaves a dimension out, ``-1`` takes
    the rest; a wrong product raises ``ValueError`` listing the valid factorizations.
    """

    def __init__(self, world_size: int, *, dp: Optional[int] = None, tp: Optional[int] = None,
                 pp: Optional[int] = None, dp_replicate: Optional[int] = None,
                 dp_shard: Optional[int] = None):
        self.world_size = world_size
        self.sizes: Dict[str, int] = resolve_sizes(world_size, dp=dp, tp=tp, pp=pp,
                                                   dp_replicate=dp_replicate, dp_shard=dp_shard)

    @property
    def names(self) -> Tuple[str, ...]:
        """The dimension names, outermost first (``mesh_dim_names`` of the torch mesh)."""
        return tuple(self.sizes)

    @property
    def shape(self) -> Tuple[int, ...]:
        """The mesh shape, outermost first."""
        return tuple(self.sizes.values())

    def coords(self, rank: int) -> Dict[str, int]:
        """Where ``rank`` sits: its index along each dimension."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size} ranks")
        out = {}
        for name, size in reversed(list(self.sizes.items())):
            rank, out[name] = divmod(rank, size)
        return {name: out[name] for name in self.sizes}

    def rank(self, **coords: int) -> int:
        """The rank at ``coords`` (every dimension given), e.g. ``layout.rank(dp=1, tp=0)``."""
        if set(coords) != set(self.sizes):
            raise ValueError(f"give an index for each of {', '.join(self.sizes)}, got "
                             f"{', '.join(coords) or 'none'}")
        rank = 0
        for name, size in self.sizes.items():
            if not 0 <= coords[name] < size:
                raise ValueError(f"{name}={coords[name]} is outside 0..{size - 1}")
            rank = rank * size + coords[name]
        return rank

    def groups(self, dim: str) -> List[List[int]]:
        """The ranks that form each group along ``dim`` (what ``mesh.get_group(dim)`` spans on
        them), ordered by their first rank."""
        if dim not in self.sizes:
            raise ValueError(f"this mesh has no dimension {dim!r}; it has "
                             f"{', '.join(self.sizes)}")
        found: Dict[Tuple, List[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            key = tuple(v for k, v in c.items() if k != dim)
            found.setdefault(key, []).append(rank)
        return sorted(found.values())

    def grid(self) -> List[Tuple[Dict[str, int], List[List[int]]]]:
        """The ranks as 2-D grids: ``[(outer coords, rows)]``, one grid per index of the outer
        dimensions; rows run along the second-to-last dimension, columns along the last."""
        names = list(self.sizes)
        inner = names[-2:] if len(names) > 1 else names
        outer = names[:-len(inner)]
        rows_dim = inner[0] if len(inner) == 2 else None
        col_dim = inner[-1]
        out = []
        for idx in itertools.product(*(range(self.sizes[d]) for d in outer)):
            fixed = dict(zip(outer, idx))
            rows = []
            for r in range(self.sizes[rows_dim] if rows_dim else 1):
                row = []
                for c in range(self.sizes[col_dim]):
                    at = dict(fixed, **({rows_dim: r} if rows_dim else {}), **{col_dim: c})
                    row.append(self.rank(**at))
                rows.append(row)
            out.append((fixed, rows))
        return out

    def _title(self) -> str:
        dims = " x ".join(f"{d}={s}" for d, s in self.sizes.items())
        return f"mesh {dims} over {self.world_size} ranks"

    def _axes(self):
        names = list(self.sizes)
        return (names[-2] if len(names) > 1 else None), names[-1]

    def __str__(self) -> str:
        rows_dim, col_dim = self._axes()
        width = max(len(str(self.world_size - 1)), len(f"{col_dim}={self.sizes[col_dim] - 1}"))
        label = max(len(f"{rows_dim}={self.sizes[rows_dim] - 1}") if rows_dim else 0, 1)
        lines = [self._title() + " (row-major: the last dimension is the innermost)"]
        for fixed, rows in self.grid():
            if fixed:
                lines.append(", ".join(f"{k}={v}" for k, v in fixed.items()) + ":")
            lines.append(" " * label + "  " + "  ".join(
                f"{col_dim}={c}".rjust(width) for c in range(self.sizes[col_dim])))
            for r, row in enumerate(rows):
                name = f"{rows_dim}={r}" if rows_dim else ""
                lines.append(name.ljust(label) + "  " + "  ".join(str(x).rjust(width)
                                                                  for x in row))
        for dim in self.sizes:
            lines.append(f"groups along {dim}: " + " ".join(str(g) for g in self.groups(dim)))
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows_dim, col_dim = self._axes()
        parts = [f"<div><b>{html.escape(self._title())}</b>"]
        for fixed, rows in self.grid():
            head = ", ".join(f"{k}={v}" for k, v in fixed.items())
            parts.append("<table style='display:inline-table;margin:4px 12px 4px 0'>")
            if head:
                parts.append(f"<caption>{html.escape(head)}</caption>")
            parts.append("<tr><th></th>" + "".join(f"<th>{col_dim}={c}</th>"
                                                    for c in range(self.sizes[col_dim])) + "</tr>")
            for r, row in enumerate(rows):
                name = f"{rows_dim}={r}" if rows_dim else ""
                parts.append(f"<tr><th>{name}</th>" + "".join(
                    f"<td style='text-align:center'>rank {x}</td>" for x in row) + "</tr>")
            parts.append("</table>")
        parts.append("<ul>" + "".join(
            f"<li>groups along <b>{dim}</b>: {html.escape(' '.join(str(g) for g in self.groups(dim)))}</li>"
            for dim in self.sizes) + "</ul></div>")
        return "".join(parts)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{d}={s}" for d, s in self.sizes.items())
        return f"MeshLayout({self.world_size}, {sizes})"

    def plot(self, ax=None):
        """Draw the ranks in their grid, coloured by their group along the last dimension
        (needs matplotlib); returns the Axes."""
        from ..ui.plots.mesh import plot_mesh

        return plot_mesh(self, ax=ax)
