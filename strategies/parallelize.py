"""The parallelisms FSDP's family applies to a model, each a free function, applied in this order (torchtitan's):

1. `apply_tp`: tensor parallel splits each layer over the TP group;
2. `apply_ac`: activation checkpointing of each unit, before sharding, so that FSDP's hooks surround the checkpointed
   unit and its parameters are gathered again when backward recomputes it;
3. `apply_compile`: each unit compiled, after checkpointing (its graph holds the recomputation boundary) and before
   sharding (FSDP's all-gathers and reduce-scatters stay outside the graph, where they overlap with compute);
4. `apply_fsdp`: data-parallel sharding (FSDP2's `fully_shard`), innermost unit first.

`strategies.fsdp.FSDP.setup` calls them in that order on the model built on the meta device (the pipeline's, on
each stage), over the meshes `device_meshes` makes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from strategies.units import compile_units


class Meshes(NamedTuple):
    """The run's device meshes: FSDP's (1-D, or HSDP's replicate x shard), tensor parallel's and the pipeline's (None:
    that dimension is 1), and the whole one they are dimensions of."""

    dp: Any
    tp: Any
    pp: Any
    whole: Any


def device_meshes(device_type: str, replicate: int, shard: int, tp: int = 1, pp: int = 1) -> Meshes:
    """One device mesh of (pp x) (replicate x) shard (x tp), torchtitan's order: the `tp` consecutive ranks of a node
    one tensor-parallel group, a stage's data-parallel ranks next (FSDP's gathers on the fastest links left), a
    pipeline across them; each dimension of size 1 left out."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = ("replicate", "shard") if replicate > 1 else ("shard",)  # HSDP: dim 0 replicates, dim 1 shards
    dims = {"pp": pp, "replicate": replicate, "shard": shard, "tp": tp}
    names = tuple(n for n in ("pp", *dp, "tp") if n in dp or dims[n] > 1)
    mesh = init_device_mesh(device_type, tuple(dims[n] for n in names), mesh_dim_names=names)
    if names == dp:
        return Meshes(mesh, None, None, mesh)
    return Meshes(mesh[dp], mesh["tp"] if tp > 1 else None, mesh["pp"] if pp > 1 else None, mesh)


def apply_tp(model: nn.Module, tp: Any, tp_mesh: Any) -> None:
    """Tensor parallel by the model's plan over `tp_mesh` (`strategies.tensor_parallel`); nothing where it is None."""
    if tp_mesh is not None:
        tp.apply(model, tp_mesh)


def apply_ac(units: list[nn.Module]) -> None:
    """Activation checkpointing of each unit. The composable form keeps parameter names and classes, so checkpoints
    load with or without it."""
    from torch.distributed._composable import checkpoint

    for unit in units:
        checkpoint(unit)


def apply_compile(units: list[nn.Module]) -> None:
    """Each unit compiled on its own (`strategies.units.compile_units`)."""
    compile_units(units)


def apply_fsdp(
    model: nn.Module,
    units: list[nn.Module],
    mesh: Any,
    *,
    reshard_after_forward: bool,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    offload: bool,
    device_type: str,
) -> None:
    """FSDP2 over `mesh` (HSDP: a 2-D mesh), each unit first and then the whole model, with the precision's
    parameter and reduction dtypes; `offload` keeps the shards and the optimizer's state in host memory."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory needs CUDA; without it, pinning fails ("Cannot access accelerator device").
    policy = CPUOffloadPolicy(pin_memory=device_type == "cuda") if offload else OffloadPolicy()
    # Innermost first: a unit nested in another must be sharded before its parent claims its parameters.
    for module in [*reversed(units), model]:
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=precision,
            offload_policy=policy,
        )
