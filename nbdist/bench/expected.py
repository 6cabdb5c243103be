"""The analytic traffic of a layer plan: what each mesh dimension should send per training step.

:func:`expected_traffic` is arithmetic on the unwrapped model (it runs anywhere, the kernel too):
per mesh dimension and collective, the calls and bytes (nccl-tests' size: the tensor of an
all_reduce, the gathered output of an all_gather, the input of a reduce_scatter) of one forward
and backward, per rank. The rules, for ``T`` tokens (batch x sequence) and ``e`` bytes per element:

* **tensor parallel over** ``tp`` (Megatron-LM's pairs; Shoeybi et al. 2019, section 3): a
  ``RowwiseParallel`` layer all-reduces its output in the forward (``T x out_features x e``), a
  ``ColwiseParallel`` layer all-reduces the gradient of its input in the backward (``T x
  in_features x e``) -- so q, k and v each have one -- unless it reads the model's input (no
  module with parameters before it in module order), whose gradient is not computed. Nothing
  else crosses ``tp``: the weights are
  sharded, norms and Rowwise biases are replicated and their gradients equal on every rank.
* **FSDP2 over** ``dp`` (or ``dp_shard``): each module that owns parameters is one
  ``fully_shard`` group (as :mod:`nbdist.strategies` wraps them). Per group: one all_gather of its
  parameters in the forward, one more in the backward when it reshards after the forward (the
  default; never for the root), and one reduce_scatter of its gradients. The size is the group's
  parameters as this rank holds them after tensor parallel, each padded along dimension 0 to a
  multiple of the shard count, as FSDP2 pads them.
* **HSDP**: the same over ``dp_shard``, plus one all_reduce per group across ``dp_replicate`` of
  the reduce-scattered gradient (the group's size / ``dp_shard``).

* **sequence parallel** (``sequence_parallel=True``, Korthikanti et al. 2022, as
  :func:`nbdist.parallel.auto_plan` writes it: each block takes its input whole, works on sequence
  shards in its norms, and gives its output back whole): per block, with ``h`` the block's width,
  ``T x h x e`` each -- forward: an all_gather into the attention and into the MLP, a
  reduce_scatter out of each (their Rowwise layers), an all_gather of the block's output;
  backward: the mirror image (a reduce_scatter for each forward all_gather into attention and
  MLP, an all_gather for each reduce_scatter) plus an all_gather of the gradient of the block's
  input -- unless that input is the model's own (no module with parameters before the block). So
  6 all_gathers (5 for a first block) and 4 reduce_scatters per block; no all_reduce inside it,
  except under FSDP2 (``fsdp2+tp``): the gradient of each parameter of a ``SequenceParallel``
  norm is partial over ``tp`` and is all-reduced there (its size) before FSDP2 reduce-scatters it
  (measured; plain ``tp`` issues none).
* **pipeline over** ``pp`` (``strategy="pp"``, as :func:`nbdist.parallel.pipeline` splits the
  model): per microbatch and stage boundary, one ``send`` of the activation forward (the stage
  before the boundary to the stage after it) and one ``send`` of its gradient backward (the other
  way), each ``T / m x w x e`` for ``m`` microbatches and ``w`` the features per token the stage
  before the boundary outputs; each send is a ``recv`` on the other rank. A rank's figure depends
  on its stages (the first and the last have one neighbour), so the rows are the **mean over the
  ranks** (what :meth:`Traffic.compare` compares with; ``rank=`` gives one rank's). Plus one
  all_reduce of 8 bytes per step: :meth:`~nbdist.parallel.Pipeline.step`'s check that every rank's
  batch is valid. The schedule changes the order of the sends, not their number.
"""
from __future__ import annotations

from fnmatch import fnmatch
from typing import Dict, List, Optional, Sequence

from .records import Table

STRATEGIES = ("tp", "fsdp2+tp", "hsdp", "pp")
_WIDTH = ("out_features", "embedding_dim", "normalized_shape")


def _named(model, key: str):
    """The modules a plan key names, resolved as ``parallelize_module`` does (fnmatch per part)."""
    found = [("", model)]
    for token in [t for t in key.split(".") if t]:
        found = [(f"{name}.{child_name}".lstrip("."), child) for name, mod in found
                 for child_name, child in mod.named_children() if fnmatch(child_name, token)]
    return found


def _styles(model, plan) -> Dict[str, str]:
    """``{module name: "colwise" | "rowwise" | other style name}`` for the plan's modules."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {}
    for key, style in plan.items():
        kind = ("colwise" if isinstance(style, ColwiseParallel) else
                "rowwise" if isinstance(style, RowwiseParallel) else type(style).__name__)
        for name, _ in _named(model, key):
            out[name] = kind
    return out


def _local_numel(shape, kind: Optional[str], name: str, tp: int) -> List[int]:
    """The shape of a parameter on one tp rank."""
    shape = list(shape)
    if kind == "colwise":
        shape[0] //= tp
    elif kind == "rowwise" and name == "weight" and len(shape) > 1:
        shape[1] //= tp
    return shape


def _fsdp_groups(model, styles: Dict[str, str], tp: int, shards: int, elt: int) -> List[Dict]:
    """One entry per ``fully_shard`` group: ``bytes`` (padded, all shards) and ``root``."""
    groups = []
    for mod_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        if not params:
            continue
        total = 0
        for pname, p in params:
            shape = _local_numel(p.shape, styles.get(mod_name), pname, tp)
            rest = 1
            for d in shape[1:]:
                rest *= d
            total += -(-shape[0] // shards) * shards * rest if shape else 1
        groups.append({"bytes": total * elt, "root": module is model})
    return groups


def _width(layers, stage: int, first: int) -> int:
    """Features per token that a stage's output has: the last module (in module order) of its
    layers with ``out_features``, ``embedding_dim`` or ``normalized_shape``."""
    for layer in reversed(layers):
        for mod in reversed(list(layer.modules())):
            for attr in _WIDTH:
                value = getattr(mod, attr, None)
                if isinstance(value, (tuple, list)) and value:
                    value = value[-1]
                if isinstance(value, int):
                    return value
    raise ValueError(f"expected_traffic(..., 'pp') cannot tell the width of what stage {stage} "
                     f"(layers from {first}) sends: none of its modules has out_features, "
                     f"embedding_dim or normalized_shape; pass widths=[...] (the features per "
                     f"token each stage but the last outputs)")


def _pipeline_rows(model, tokens: int, ranks: int, schedule: str, microbatches: int, split,
                   stages_per_rank, widths, rank, elt: int) -> List[Dict]:
    """The rows of ``strategy="pp"`` (see the module docstring)."""
    from torch import nn

    from ..parallel.pipeline import plan

    if isinstance(model, (list, tuple)) and not isinstance(model, nn.Module):
        stages = [[m] for m in model]
        bounds = plan(len(stages), ranks, schedule, microbatches, None, stages_per_rank)
    else:
        layers = list(model.children())
        bounds = plan(len(layers), ranks, schedule, microbatches, split, stages_per_rank)
        stages = [layers[a:b] for a, b in bounds]
    n = len(stages)
    if widths is None:
        widths = [_width(stages[s], s, bounds[s][0]) for s in range(n - 1)]
    elif len(widths) != n - 1:
        raise ValueError(f"widths= lists the features per token each stage but the last sends: "
                         f"{n - 1} ints for {n} stages, got {len(widths)}")
    if rank is not None and not 0 <= rank < ranks:
        raise ValueError(f"rank={rank} is outside 0..{ranks - 1}")
    # At each boundary of a stage a rank holds: per microbatch, one send and one recv (the
    # activation forward one way, its gradient backward the other), summed over the ranks counted.
    calls = nbytes = 0
    for r in ([rank] if rank is not None else range(ranks)):
        for s in range(r, n, ranks):
            for boundary in (s - 1, s):  # before the stage and after it
                if 0 <= boundary < n - 1:
                    calls += microbatches
                    nbytes += microbatches * (tokens * widths[boundary] * elt // microbatches)
    count = 1 if rank is not None else ranks
    rows = [{"dim": "pp", "ranks": ranks, "op": "all_reduce", "calls": 1, "bytes": 8}]
    if calls:
        rows += [{"dim": "pp", "ranks": ranks, "op": op, "calls": calls / count,
                  "bytes": nbytes / count} for op in ("recv", "send")]
    return rows if ranks > 1 else []


def expected_traffic(model, strategy: str, *, tokens: int, world_size: int,
                     tp: Optional[int] = None, dp_shard: Optional[int] = None, plan=None,
                     sequence_parallel: bool = False, reshard_after_forward: bool = True,
                     param_bytes: int = 4, activation_bytes: int = 4,
                     schedule: str = "1f1b", microbatches: int = 4,
                     split: Optional[Sequence[int]] = None,
                     stages_per_rank: Optional[int] = None,
                     widths: Optional[Sequence[int]] = None,
                     rank: Optional[int] = None) -> Table:
    """Per mesh dimension and op, the ``calls`` and ``bytes`` one training step (forward and
    backward) should issue on each rank under ``strategy`` (see the module docstring for the
    rules). Rows also carry ``ranks`` (the dimension's size). Compare with the measured
    :class:`~nbdist.bench.Traffic` via ``traffic.compare(expected)``.

    Args:
        model: the model *before* wrapping (its full shapes); not changed.
        strategy: ``"tp"``, ``"fsdp2+tp"`` or ``"hsdp"``, with the same options as
            :func:`nbdist.strategies.wrap`: ``tp`` (fsdp2+tp, default 2), ``dp_shard`` (hsdp,
            default half the world), ``plan`` (default :func:`nbdist.parallel.auto_plan`); or
            ``"pp"``, a pipeline over the whole world with the options of
            :func:`nbdist.parallel.pipeline`: ``schedule``, ``microbatches``, ``split``,
            ``stages_per_rank`` (``model``: the ``nn.Sequential``, or the list of stages).
        tokens: activations' rows per rank per step: batch x sequence (what one tp group sees;
            for ``"pp"`` the whole batch of a step, split into ``microbatches``).
        widths: ``"pp"`` only: the features per token each stage but the last sends (default:
            read off the stage's last module with ``out_features``, ``embedding_dim`` or
            ``normalized_shape``).
        rank: ``"pp"`` only: this rank's figure instead of the mean over the ranks.
        world_size: the number of ranks.
        param_bytes, activation_bytes: bytes per element of parameters/gradients and of
            activations (4 for float32).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"expected_traffic() knows the strategies {', '.join(STRATEGIES)}; got "
                         f"{strategy!r}")
    from ..parallel import MeshLayout, auto_plan

    if strategy == "pp":
        return Table(_pipeline_rows(model, tokens, world_size, schedule, microbatches, split,
                                    stages_per_rank, widths, rank, activation_bytes))
    if strategy == "tp":
        layout = MeshLayout(world_size, tp=world_size)
    elif strategy == "fsdp2+tp":
        layout = MeshLayout(world_size, dp=-1, tp=tp or 2)
    else:
        layout = MeshLayout(world_size, dp_replicate=-1,
                            dp_shard=dp_shard or (world_size // 2 if world_size % 2 == 0
                                                  else world_size))
    sizes = dict(zip(layout.names, layout.shape))
    rows: Dict[tuple, Dict] = {}

    def add(dim, op, nbytes, calls=1):
        if sizes.get(dim, 1) <= 1 or nbytes <= 0:
            return
        row = rows.setdefault((dim, op), {"dim": dim, "ranks": sizes[dim], "op": op,
                                          "calls": 0, "bytes": 0})
        row["calls"] += calls
        row["bytes"] += nbytes * calls

    ntp = sizes.get("tp", 1)
    styles: Dict[str, str] = {}
    if "tp" in sizes:
        styles = _styles(model, plan if plan is not None
                         else auto_plan(model, sequence_parallel=sequence_parallel))
        before = False  # has a module with parameters run before this one (module order)?
        blocks: List[str] = []  # sequence-parallel blocks: their insides are counted as a whole
        for name, mod in model.named_modules():
            kind = styles.get(name)
            if any(name.startswith(b + ".") for b in blocks):
                if kind == "SequenceParallel" and ("dp" in sizes or "dp_shard" in sizes):
                    for p in mod.parameters(recurse=False):  # FSDP2 reduces its partial grad
                        add("tp", "all_reduce", p.numel() * param_bytes)
                before = before or any(True for _ in mod.parameters(recurse=False))
                continue
            if kind == "PrepareModuleInputOutput":  # a block under sequence parallel
                blocks.append(name)
                width = next(m.in_features for m in mod.modules() if hasattr(m, "in_features"))
                size = tokens * width * activation_bytes
                add("tp", "all_gather", size, 6 if before else 5)
                add("tp", "reduce_scatter", size, 4)
            elif kind == "rowwise":
                add("tp", "all_reduce", tokens * mod.out_features * activation_bytes)
            elif kind == "colwise" and before:
                add("tp", "all_reduce", tokens * mod.in_features * activation_bytes)
            before = before or any(True for _ in mod.parameters(recurse=False))
    shard_dim = "dp" if "dp" in sizes else "dp_shard" if "dp_shard" in sizes else None
    if shard_dim is not None:
        shards = sizes[shard_dim]
        for group in _fsdp_groups(model, styles, ntp, shards, param_bytes):
            gathers = 2 if reshard_after_forward and not group["root"] else 1
            add(shard_dim, "all_gather", group["bytes"], gathers)
            add(shard_dim, "reduce_scatter", group["bytes"])
            if "dp_replicate" in sizes:
                add("dp_replicate", "all_reduce", group["bytes"] // shards)
    return Table(rows[k] for k in sorted(rows))
