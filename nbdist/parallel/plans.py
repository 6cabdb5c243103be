"""Tensor-parallel plans: which layer is split how, found automatically or given, checked, applied.

A plan is torch's own format, the one ``parallelize_module`` takes: a dict ``{module name:
ParallelStyle}`` (names relative to the model, ``*`` matching any one name part, ``""`` the model
itself). :func:`auto_plan` writes one for the layers it recognises; print it, change it, pass it
back as ``plan=``. :func:`tensor_parallel` checks a plan against the model and the tp size (a layer
whose split dimension tp does not divide is named, with its size) and applies it.

What :func:`auto_plan` recognises (Megatron-LM's pairing: a column-parallel layer, elementwise
work on the shards, a row-parallel layer whose all-reduce makes the result whole again):

* **stacks of** ``nn.Linear`` **in an** ``nn.Sequential`` (activations and dropout between them):
  Linear layers pair up as Colwise then Rowwise; a Linear without a partner after it (the odd
  last one, or one followed by a LayerNorm or another non-elementwise module) stays replicated.
* **attention** modules with separate ``nn.Linear`` children for q, k, v and the output
  (named ``q/k/v/o``, ``wq/wk/wv/wo``, ``q_proj/k_proj/v_proj/o_proj`` or ``out_proj``,
  ``query/key/value/out``): q, k, v Colwise (each rank gets whole heads), the output Rowwise.
  Head-count attributes (``n_heads``, ``num_heads``, ``n_head``, ``n_kv_heads``,
  ``num_key_value_heads``) are divided by tp when the plan is applied, so a forward that reshapes
  with them sees its local heads.
* **MLP** modules: Linear children ``fc1/fc2``, ``w1/w2(/w3)`` (SwiGLU), ``c_fc/c_proj``,
  ``up_proj/down_proj(/gate_proj)``, ``linear1/linear2``, or an ``nn.Sequential`` of two Linear
  layers with elementwise modules between: the "up" layers Colwise, the "down" layer Rowwise.
* ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer``: the feed-forward
  (``linear1`` Colwise, ``linear2`` Rowwise); the attention stays replicated, because
  ``nn.MultiheadAttention`` packs q, k, v into one ``in_proj_weight`` that a plan cannot split.

Everything else (norms, embeddings, a head) stays replicated on every rank.

**Sequence parallel** (``sequence_parallel=True``, Korthikanti et al. 2022) applies to
*transformer blocks*: modules whose children are an attention and/or an MLP as above plus norms
(``nn.LayerNorm``, ``nn.RMSNorm``) and parameter-free modules. Inside a block the activations are
split along the sequence (dimension 1 of ``(batch, seq, dim)``): the norms run as
``SequenceParallel``, the attention and the MLP gather the sequence on the way in
(``PrepareModuleInput``: Shard(1) -> Replicate) and reduce-scatter it on the way out (the Rowwise
layers' output is Shard(1)). Each block takes its input whole and gives its output whole
(``PrepareModuleInputOutput``: Replicate -> Shard(1) in, Shard(1) -> Replicate out), so blocks
work inside any model; the block's forward takes the activations as its one positional argument.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from torch import nn

Plan = Dict[str, object]  #: ``{module name: ParallelStyle}``, as ``parallelize_module`` takes it

_Q = ("q", "wq", "q_proj", "query")
_K = ("k", "wk", "k_proj", "key")
_V = ("v", "wv", "v_proj", "value")
_O = ("o", "wo", "o_proj", "out_proj", "out")
_UP = ("fc1", "w1", "w3", "c_fc", "up_proj", "gate_proj", "linear1")
_DOWN = ("fc2", "w2", "c_proj", "down_proj", "linear2")
HEAD_ATTRS = ("n_heads", "num_heads", "n_head", "n_kv_heads", "num_key_value_heads")
_ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish,
                nn.Hardswish, nn.ReLU6, nn.Softplus, nn.Dropout, nn.Identity)
_NORMS = tuple(t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None)
_TORCH_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
HOW_TO_PASS = ("pass your own plan: plan={'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()} "
               "(module name -> a torch.distributed.tensor.parallel style), e.g. "
               "strategies.wrap('tp', model, make_optimizer, plan=plan)")


def _styles():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleInputOutput, RowwiseParallel,
                                                   SequenceParallel)

    return (Replicate, Shard, ColwiseParallel, RowwiseParallel, SequenceParallel,
            PrepareModuleInput, PrepareModuleInputOutput)


def _linears(module: nn.Module) -> Dict[str, nn.Linear]:
    return {n: c for n, c in module.named_children() if isinstance(c, nn.Linear)}


def _owns_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def unit_kind(module: nn.Module) -> Optional[str]:
    """``"attention"``, ``"mlp"`` or None: what :func:`auto_plan` takes ``module`` for."""
    if isinstance(module, nn.Sequential):
        kids = list(module.children())
        if (sum(isinstance(c, nn.Linear) for c in kids) == 2
                and all(isinstance(c, (nn.Linear,) + _ELEMENTWISE) for c in kids)):
            return "mlp"
        return None
    lin = _linears(module)
    others = [c for c in module.children() if not isinstance(c, nn.Linear)]
    if _owns_params(module) or any(any(True for _ in c.parameters()) for c in others):
        return None
    names = set(lin)
    if (all(names & set(role) for role in (_Q, _K, _V)) and len(names & set(_O)) == 1
            and names <= set(_Q + _K + _V + _O)):
        return "attention"
    if names & set(_UP) and len(names & set(_DOWN)) == 1 and names <= set(_UP + _DOWN):
        return "mlp"
    return None


def _unit_plan(module: nn.Module, prefix: str, plan: Plan, sp: bool) -> None:
    _, Shard, Colwise, Rowwise, _, PrepareIn, _ = _styles()
    kind = unit_kind(module)
    if isinstance(module, nn.Sequential):
        first, last = [n for n, c in module.named_children() if isinstance(c, nn.Linear)]
        ups, down = [first], last
    elif kind == "attention":
        names = list(_linears(module))
        ups, down = [n for n in names if n not in _O], next(n for n in names if n in _O)
    else:
        names = list(_linears(module))
        ups, down = [n for n in names if n in _UP], next(n for n in names if n in _DOWN)
    if sp:
        from torch.distributed.tensor import Replicate

        plan[prefix.rstrip(".")] = PrepareIn(input_layouts=(Shard(1),),
                                             desired_input_layouts=(Replicate(),))
    for name in ups:
        plan[prefix + name] = Colwise()
    plan[prefix + down] = Rowwise(output_layouts=Shard(1)) if sp else Rowwise()


def _block_parts(module: nn.Module) -> Optional[List[Tuple[str, nn.Module, str]]]:
    """``[(child name, child, "unit" | "norm" | "mha")]`` when ``module`` is a transformer block."""
    parts, units = [], 0
    for name, child in module.named_children():
        if unit_kind(child):
            parts.append((name, child, "unit"))
            units += 1
        elif isinstance(child, _NORMS):
            parts.append((name, child, "norm"))
        elif isinstance(child, nn.MultiheadAttention):
            parts.append((name, child, "mha"))
        elif any(True for _ in child.parameters()) or isinstance(child, nn.Sequential):
            return None
    if units == 0 or _owns_params(module) or isinstance(module, nn.Sequential):
        return None
    return parts


def _mha_error(name: str, cls: str = "nn.MultiheadAttention") -> ValueError:
    return ValueError(
        f"sequence_parallel=True cannot shard {name!r} ({cls}): it packs q, k and v into one "
        "in_proj_weight and computes the heads inside F.multi_head_attention_forward, so no plan "
        "can split its heads or gather the sequence around it. Use a block with separate q/k/v/o "
        "nn.Linear layers (nbdist.parallel.TransformerBlock is one), or " + HOW_TO_PASS + ". "
        "Without sequence_parallel, auto_plan shards the block's feed-forward and keeps this "
        "attention replicated.")


def _visit(module: nn.Module, prefix: str, plan: Plan, sp: bool, blocks: List[str]) -> None:
    _, Shard, Colwise, Rowwise, SeqPar, _, PrepareInOut = _styles()
    if isinstance(module, _TORCH_LAYERS):
        if sp:
            raise _mha_error(prefix + "self_attn")
        plan[prefix + "linear1"], plan[prefix + "linear2"] = Colwise(), Rowwise()
        return
    parts = _block_parts(module) if sp else None
    if parts is not None:
        from torch.distributed.tensor import Replicate

        blocks.append(prefix.rstrip("."))
        plan[prefix.rstrip(".")] = PrepareInOut(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
            output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),))
        for name, child, kind in parts:
            if kind == "mha":
                raise _mha_error(prefix + name)
            if kind == "norm":
                plan[prefix + name] = SeqPar()
            else:
                _unit_plan(child, prefix + name + ".", plan, sp=True)
        return
    if unit_kind(module):
        _unit_plan(module, prefix, plan, sp=False)
        return
    if isinstance(module, nn.Sequential):
        _stack_plan(module, prefix, plan, sp, blocks)
        return
    for name, child in module.named_children():
        _visit(child, prefix + name + ".", plan, sp, blocks)


def _flatten(seq: nn.Sequential, prefix: str) -> List[Tuple[str, nn.Module]]:
    out = []
    for name, child in seq.named_children():
        if isinstance(child, nn.Sequential) and not unit_kind(child):
            out += _flatten(child, prefix + name + ".")
        else:
            out.append((prefix + name, child))
    return out


def _stack_plan(seq: nn.Sequential, prefix: str, plan: Plan, sp: bool, blocks: List[str]) -> None:
    _, _, Colwise, Rowwise, _, _, _ = _styles()
    items = _flatten(seq, prefix)
    sharded = False
    for i, (name, child) in enumerate(items):
        if isinstance(child, nn.Linear):
            if sharded:
                plan[name], sharded = Rowwise(), False
                continue
            after = next((c for _, c in items[i + 1:] if not isinstance(c, _ELEMENTWISE)), None)
            if isinstance(after, nn.Linear):  # else: no partner, the layer stays replicated
                plan[name], sharded = Colwise(), True
        elif not isinstance(child, _ELEMENTWISE):
            _visit(child, name + ".", plan, sp, blocks)


def auto_plan(model: nn.Module, sequence_parallel: bool = False) -> Plan:
    """A tensor-parallel plan for ``model``: ``{module name: ParallelStyle}`` (see the module
    docstring for what is recognised). Print it, change it, pass it back as ``plan=``.

    Raises ``ValueError`` naming the modules when nothing in the model can be sharded, or when
    ``sequence_parallel=True`` meets no transformer block or an ``nn.MultiheadAttention``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"auto_plan() takes an nn.Module, got {type(model).__name__}")
    plan: Plan = {}
    blocks: List[str] = []
    _visit(model, "", plan, bool(sequence_parallel), blocks)
    if not plan:
        held = [f"{n or '(the model)'} ({type(m).__name__})" for n, m in model.named_modules()
                if _owns_params(m)][:8]
        raise ValueError(
            f"auto_plan found nothing to shard in {type(model).__name__}: it knows nn.Sequential "
            "stacks of nn.Linear, attention modules with q/k/v/o Linear layers, MLP modules "
            "(fc1/fc2, w1/w2/w3, ...) and nn.TransformerEncoderLayer's feed-forward. The "
            f"parameters here sit in {', '.join(held) or 'no module (it has none)'}. To split "
            "them, " + HOW_TO_PASS + ".")
    if sequence_parallel and not blocks:
        raise ValueError(
            f"sequence_parallel=True needs transformer blocks, and {type(model).__name__} has "
            "none: a block is a module holding an attention (q/k/v/o nn.Linear layers) and/or an "
            "MLP next to its norms (nn.LayerNorm, nn.RMSNorm). Leave sequence_parallel off for "
            "plain tensor parallel, or " + HOW_TO_PASS + " with SequenceParallel() for the norms.")
    return plan


def describe(plan: Plan) -> str:
    """The plan as text, one ``name: style`` line each (``""`` shown as ``(the model)``)."""
    return "\n".join(f"{name or '(the model)'}: {style!r}" for name, style in plan.items())
