"""What each rank holds under ``tp``, ``fsdp2+tp`` and ``hsdp``: sharded and replicated bytes.

:func:`split_on_rank` runs on a rank after the last step. It sorts every parameter into

* **sharded** -- a DTensor the tensor-parallel plan splits (a ``Shard`` placement on the ``tp``
  mesh dimension); under ``hsdp`` (no ``tp`` dimension) every parameter FSDP2 shards;
* **replicated** -- whole on every tensor-parallel rank: norms, the biases of Rowwise layers,
  layers the plan leaves out (plain tensors, or DTensors that are ``Replicate`` on ``tp``).
  Under ``fsdp2+tp`` FSDP2 still shards them over ``dp`` (``fully_shard`` shards every parameter
  on dim 0), so their local bytes are 1/dp of the full ones.

and adds up, per class, the local bytes (``DTensor.to_local()``: ``numel x element size``) of the
parameter, its ``.grad`` and its optimizer state (Adam's ``exp_avg``/``exp_avg_sq``; the 0-d
``step`` counters are counted apart, as ``steps``). It also returns the full element counts Ψ_s
and Ψ_r and the mesh sizes, from which :func:`mesh_estimate` computes the per-rank formula on the
kernel:

=========  ==========================================  ===========================================
strategy   per-rank parameters (bytes: x (P + G + K))   source
=========  ==========================================  ===========================================
tp         Ψ_s/tp + Ψ_r                                 Megatron-LM (Shoeybi et al. 2019, sec. 3):
                                                        column/row-parallel weights split over tp;
                                                        norms and row-parallel biases replicated
fsdp2+tp   Ψ_s/(dp·tp) + Ψ_r/dp                         the TP shard above, then ZeRO-3 over dp
                                                        (Rajbhandari et al. 2020); FSDP2 shards the
                                                        replicated parameters over dp too
hsdp       Ψ/dp_shard                                   ZeRO-3 inside each dp_shard group, whole
                                                        replicas across dp_replicate (hybrid
                                                        sharding, Zhao et al. 2023, PyTorch FSDP)
=========  ==========================================  ===========================================

Sharded parts are rounded up per rank (``ceil``). FSDP2 pads a parameter whose dim 0 the dp size
does not divide: its storage is larger than its local shard; that padding is returned too.
"""
from __future__ import annotations

import math
from typing import Any, Dict

from torch import nn

from .formulas import OPTIMIZERS, Estimate

MESHED = ("tp", "fsdp2+tp", "hsdp")
_DP_NAMES = ("dp", "dp_shard")


def _classify(p, by_tp: bool) -> tuple:
    """``(kind, tp, dp)`` of one parameter: "sharded"/"replicated", its tp and dp-shard sizes.
    ``by_tp``: sharded means split by the tensor-parallel plan (``tp``, ``fsdp2+tp``: a norm
    FSDP2 put on the ``dp`` mesh alone is replicated); else split at all (``hsdp``)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return "replicated", 1, 1
    names = p.device_mesh.mesh_dim_names or ()
    sizes = dict(zip(names, p.device_mesh.shape))
    shard = {n: pl.is_shard() for n, pl in zip(names, p.placements)}
    dp = math.prod(sizes[n] for n in _DP_NAMES if shard.get(n))
    if by_tp:
        return ("sharded" if shard.get("tp") else "replicated"), sizes.get("tp", 1), dp
    return ("sharded" if any(shard.values()) else "replicated"), 1, dp


def _local(t) -> tuple:
    """``(local bytes, storage bytes)`` of a tensor or DTensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size(), t.untyped_storage().nbytes()


def split_on_rank(model: nn.Module, opt, strategy: str = "tp") -> Dict[str, Any]:
    """This rank's local bytes of params, grads and optimizer state, sharded vs replicated
    (``strategy``: ``"tp"``, ``"fsdp2+tp"`` or ``"hsdp"``)."""
    out: Dict[str, Any] = {k: {"params": 0, "grads": 0, "optimizer": 0, "numel": 0, "tensors": 0}
                           for k in ("sharded", "replicated")}
    out.update(tp=1, dp=1, steps=0, padding=0)
    seen = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        kind, tp, dp = _classify(p, strategy != "hsdp")
        out["tp"], out["dp"] = max(out["tp"], tp), max(out["dp"], dp)
        part = out[kind]
        local, storage = _local(p)
        part["params"] += local
        part["numel"] += p.numel()  # the full (global) count: a DTensor's numel is its shape's
        part["tensors"] += 1
        out["padding"] += max(0, storage - local)
        if p.grad is not None:
            part["grads"] += _local(p.grad)[0]
        for key, value in opt.state.get(p, {}).items() if hasattr(opt, "state") else ():
            if not hasattr(value, "numel"):
                continue
            if key == "step" and value.dim() == 0:
                out["steps"] += _local(value)[0]
            else:
                part["optimizer"] += _local(value)[0]
    return out


def mesh_estimate(strategy: str, split: Dict[str, Any], world_size: int, precision: str = "fp32",
                  optimizer: str = "adam") -> Estimate:
    """The per-rank formula of ``strategy`` for the sharded/replicated split a rank reported."""
    p = g = 4 if precision == "fp32" else 2
    k = OPTIMIZERS[optimizer][0 if precision == "fp32" else 1]
    s, r = split["sharded"]["numel"], split["replicated"]["numel"]
    tp, dp = split["tp"], split["dp"]
    if strategy == "tp":
        local = math.ceil(s / tp) + r
        shape = ("TP: (P + G + K)(Ψ_s/tp + Ψ_r) (Megatron-LM, Shoeybi et al. 2019: column- and "
                 "row-parallel weights split over tp, norms and row-parallel biases replicated)")
    elif strategy == "fsdp2+tp":
        local = math.ceil(s / (dp * tp)) + math.ceil(r / dp)
        shape = ("2-D: (P + G + K)(Ψ_s/(dp·tp) + Ψ_r/dp) (Megatron-LM's TP shard, then ZeRO-3 over "
                 "dp, Rajbhandari et al. 2020; FSDP2 shards the replicated parameters over dp too)")
    elif strategy == "hsdp":
        local = math.ceil((s + r) / dp)
        shape = ("HSDP: (P + G + K)Ψ/dp_shard (ZeRO-3 inside each dp_shard group, replicas across "
                 "dp_replicate: hybrid sharding, Zhao et al. 2023)")
    else:
        raise ValueError(f"mesh_estimate() knows {', '.join(MESHED)}, got {strategy!r}")
    formula = (f"{shape} = {p + g + k} x {local:,} ({precision} {optimizer}: P={p}, G={g}, K={k} "
               f"bytes per parameter; Ψ_s={s:,} sharded, Ψ_r={r:,} replicated, tp={tp}, dp={dp}, "
               f"N={world_size})")
    return Estimate(s + r, world_size, strategy, 3, precision, optimizer, p * local, g * local,
                    k * local, formula)


def explain(rec, est: Estimate, split: Dict[str, Any]) -> list:
    """Notes: the split in words, and the difference from the formula to the byte."""
    sh, rp = split["sharded"], split["replicated"]
    notes = [f"Ψ_s={sh['numel']:,} sharded ({sh['tensors']} tensors), Ψ_r={rp['numel']:,} "
             f"replicated ({rp['tensors']} tensors; their bytes: the sharded and replicated "
             f"columns); {est.formula}"]
    diff = rec.model_state - est.total
    if diff:
        local = sum(d[x] for d in (sh, rp) for x in ("params", "grads", "optimizer"))
        parts = [f"{split['steps']:,} B of Adam step counters (4 B per tensor)"] \
            if split["steps"] else []
        if split["padding"]:
            parts.append(f"{split['padding']:,} B of FSDP2 padding (dim 0 not divisible by dp)")
        rest = rec.model_state - local - split["steps"] - split["padding"]
        uneven = local - est.total
        if uneven:
            parts.append(f"{uneven:+,} B from uneven shards (the formula rounds Ψ/dp up on "
                         f"every rank)")
        if rest:
            parts.append(f"{rest:+,} B of storage shared or not reached by the walk")
        notes.append(f"measured model state differs from the formula by "
                     f"{diff:+,} B: " + ("; ".join(parts) or "unexplained"))
    return notes
