"""FSDP2 for the native model: each decoder layer is its own shard unit (gathered just before it
runs, freed after), the embedding, final norm and LM head sit in the root unit.

FSDP2 averages gradients over ranks (a plain sum needs PREMUL_SUM, which gloo lacks). Every loss in
hybridflow divides by explicit global token / sequence counts (DESIGN principle 4), so a rank's loss
is its share of the global loss and the single-process gradient is the *sum* over ranks: each rank
multiplies its loss by `collectives.data_parallel_scale()` before backward."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from hybridflow.models.native.model import NativeModule
from hybridflow.parallel.expert import expert_parallel_parameters


def apply_fsdp(
    model: NativeModule,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    offload_params: bool = False,
) -> NativeModule:
    """Shard `model` in place over `mesh` (1-D, data parallel). `param_dtype` (e.g. bf16) is the dtype
    layers compute in; reductions stay in fp32. `offload_params` keeps shards (and so the optimizer
    state built on them) in CPU memory between uses."""
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
    }
    if offload_params and mesh.device_type != "cpu":  # on a CPU mesh the shards are in CPU memory already
        options["offload_policy"] = CPUOffloadPolicy()
    experts = expert_parallel_parameters(model)
    if experts:  # split by expert already (parallel/expert.py): each rank keeps its own whole
        options["ignored_params"] = experts
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    # the model runs through these methods, not forward(): each must gather the root unit's shards
    for name in ("hidden_states", "token_scores", "scores_at"):
        if hasattr(model, name):
            register_fsdp_forward_method(model, name)
    return model
