"""Named device meshes over the group's existing default process group (on the ranks)."""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from .layout import MeshLayout

# One mesh per (world group, device type, shape, names) on this rank: a 2-D mesh creates a process
# group per row and column, and a notebook wraps models again and again on a persistent group.
_CACHE: Dict[Tuple, Tuple[object, object]] = {}


def mesh_device_type() -> str:
    """``"cuda"`` when the group runs NCCL on a visible GPU, else ``"cpu"``."""
    backend = str(dist.get_backend()) if dist.is_initialized() else ""
    return "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"


def device_mesh(*, dp: Optional[int] = None, tp: Optional[int] = None, pp: Optional[int] = None,
                dp_replicate: Optional[int] = None, dp_shard: Optional[int] = None,
                device_type: Optional[str] = None):
    """A named torch ``DeviceMesh`` over this group's ranks; call it on every rank.

    ``device_mesh(dp=2, tp=2)`` on 4 ranks is ``init_device_mesh("cpu", (2, 2),
    mesh_dim_names=("dp", "tp"))`` on the group nbdist already started (the mesh does not create
    another one). Dimensions are ordered ``pp, dp | dp_replicate, dp_shard, tp`` (tensor parallel
    innermost: its ranks are neighbours), the sizes must multiply to the world size (``-1`` takes
    the ranks left over; a dimension left ``None`` is not in the mesh; no size at all is ``dp`` =
    the world) and a wrong product raises ``ValueError`` listing the valid factorizations.
    :class:`MeshLayout` shows which rank sits where, in the kernel too.

    Index the result by name: ``mesh["tp"]`` for ``parallelize_module``, ``mesh["dp"]`` for
    ``fully_shard``, ``mesh["dp_replicate", "dp_shard"]`` for HSDP. The same sizes on the same
    group return the same mesh (its process groups are made once).
    """
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError("device_mesh() needs torch.distributed initialised: call it on the "
                           "ranks, e.g. inside group.run(fn) or a %%dist cell. In the kernel, "
                           "nbdist.parallel.MeshLayout(world_size, ...) shows the layout.")
    layout = MeshLayout(dist.get_world_size(), dp=dp, tp=tp, pp=pp, dp_replicate=dp_replicate,
                        dp_shard=dp_shard)
    device_type = device_type or mesh_device_type()
    world = dist.group.WORLD
    key = (id(world), device_type, layout.shape, layout.names)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is world:
        return cached[1]
    for old in [k for k, (w, _) in _CACHE.items() if w is not world]:  # a restarted group
        del _CACHE[old]
    mesh = init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.names)
    _CACHE[key] = (world, mesh)
    return mesh


def mesh_ranks(mesh) -> Dict[str, list]:
    """``{dim: ranks of this rank's group along dim}`` for a named mesh (what each dimension
    talks to, as torch built it)."""
    return {name: sorted(dist.get_process_group_ranks(mesh.get_group(name)))
            for name in mesh.mesh_dim_names}


def doctor_lines() -> list:
    """What ``python -m nbdist doctor`` says about parallelism beyond data parallel here."""
    devices = "cpu (gloo)" + (", cuda (nccl)" if torch.cuda.is_available() else "")
    return [f"parallelism: device meshes, tensor + sequence parallel (tp), fsdp2+tp, hsdp on "
            f"{devices}",
            f"  context parallel: not offered (torch {torch.__version__.split('+')[0]} has no CPU "
            "sharding strategy for scaled-dot-product attention, so context_parallel does not "
            "run on CPU)"]
