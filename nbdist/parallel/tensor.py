"""Applying a tensor-parallel plan on the ranks, after checking it against the model and tp."""
from __future__ import annotations

from fnmatch import fnmatch
from typing import List, Optional, Tuple

from torch import nn

from .plans import HEAD_ATTRS, Plan, auto_plan, unit_kind


def _match(model: nn.Module, key: str) -> List[Tuple[str, nn.Module]]:
    """The modules a plan key names, resolved as ``parallelize_module`` does (fnmatch per part)."""
    found = [("", model)]
    for token in key.split(".") if key else []:
        found = [(f"{path}.{name}" if path else name, child) for path, mod in found
                 for name, child in mod.named_children() if fnmatch(name, token)]
    return found


def _split_size(module: nn.Module, style) -> Optional[Tuple[str, int]]:
    """``(what is split, its size)`` for a Colwise/Rowwise style on a Linear or an Embedding."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = isinstance(style, ColwiseParallel), isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear) and (col or row):
        return ("output features", module.out_features) if col else \
            ("input features", module.in_features)
    if isinstance(module, nn.Embedding) and (col or row):
        return ("embedding dimension", module.embedding_dim) if col else \
            ("embeddings", module.num_embeddings)
    return None


def check_plan(model: nn.Module, plan: Plan, tp: int) -> None:
    """Raise a clear error when ``plan`` does not fit ``model`` split over ``tp`` ranks: a name
    that matches no module, a value that is not a ParallelStyle, a split dimension (or a head
    count) that tp does not divide. Called by :func:`tensor_parallel` before anything changes."""
    from torch.distributed.tensor.parallel import ParallelStyle

    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a dict {{module name: ParallelStyle}} (as "
                        f"parallelize_module takes it), got {type(plan).__name__}; "
                        "nbdist.parallel.auto_plan(model) writes one to start from")
    names = [n for n, _ in model.named_modules() if n]
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"plan[{key!r}] must be a ParallelStyle (ColwiseParallel(), "
                            f"RowwiseParallel(), SequenceParallel(), ...), got "
                            f"{type(style).__name__}")
        matched = _match(model, key) if isinstance(key, str) else []
        if not matched:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(f"plan key {key!r} names no module of {type(model).__name__}; its "
                             f"modules are: {shown or '(none)'}")
        for name, module in matched:
            split = _split_size(module, style)
            if split and split[1] % tp:
                what, size = split
                raise ValueError(
                    f"tp={tp} does not divide layer {name!r} ({module}): "
                    f"{type(style).__name__} splits its {size} {what} over {tp} ranks. Choose a "
                    f"tp that divides {size}, or leave {name!r} out of the plan (replicated).")
    for name, module in _attention_with_colwise(model, plan):
        for attr in HEAD_ATTRS:
            heads = getattr(module, attr, None)
            if isinstance(heads, int) and not isinstance(heads, bool) and heads % tp:
                raise ValueError(f"tp={tp} does not divide the {heads} heads of {name!r} "
                                 f"({type(module).__name__}.{attr}): each rank must hold whole "
                                 f"heads. Choose a tp that divides {heads}.")


def _attention_with_colwise(model: nn.Module, plan: Plan) -> List[Tuple[str, nn.Module]]:
    """Attention modules (as :func:`auto_plan` recognises them) whose q/k/v the plan splits."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    split = set()
    for key, style in plan.items():
        if isinstance(style, ColwiseParallel):
            split.update(n for n, _ in _match(model, key))
    out = []
    for name, module in model.named_modules():
        if unit_kind(module) == "attention" and any(
                (f"{name}.{child}" if name else child) in split for child in
                dict(module.named_children())):
            out.append((name, module))
    return out


def tensor_parallel(model: nn.Module, mesh, plan: Optional[Plan] = None, *,
                    sequence_parallel: bool = False) -> nn.Module:
    """Split ``model`` over the 1-D mesh ``mesh`` (e.g. ``device_mesh(dp=2, tp=2)["tp"]``); call it
    on every rank of the mesh's group. Returns the model, changed in place.

    ``plan``: ``{module name: ParallelStyle}`` for ``parallelize_module``; default
    :func:`auto_plan` ``(model, sequence_parallel)``. The plan is checked first
    (:func:`check_plan`), so a mistake changes nothing and every rank raises the same error.
    The head-count attributes of the attention modules whose q/k/v are split are divided by the
    mesh size (``n_heads`` 8 -> 4 at tp=2), for their forward's reshapes.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if plan is None:
        plan = auto_plan(model, sequence_parallel=sequence_parallel)
    elif sequence_parallel:
        raise ValueError("sequence_parallel=True writes the plan itself; with plan= given, put "
                         "SequenceParallel() and the Shard(1) layouts in your plan instead")
    tp = mesh.size()
    check_plan(model, plan, tp)
    heads = _attention_with_colwise(model, plan)
    parallelize_module(model, mesh, plan)
    for _, module in heads:
        for attr in HEAD_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(module, attr, value // tp)
    return model

