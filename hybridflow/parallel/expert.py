"""Expert parallelism for the native model's mixture-of-experts layers, inside the data-parallel
group, applied from outside like tensor parallelism (the model file stays single-device).

The D data-parallel ranks form groups of P consecutive ranks (P divides D and the number of experts);
each rank of a group keeps E / P experts of every MoE layer (local rank r: experts r*E/P ..
(r+1)*E/P - 1), the same as the ranks at its place in the other groups: a DTensor sharded on the
expert dimension over the group and replicated across groups, so FSDP2 leaves it alone and
checkpoints, weight syncs and exports see whole tensors. The rest of the model is FSDP2 as before. In
a forward, each rank routes its own tokens, sends each (token, choice) row to the rank of its group
holding its expert (one all-to-all of [rows, H]), runs its experts on what it received, and sends the
results back (a second all-to-all); the backward runs the same exchanges in reverse. A rank never
gathers another rank's experts.

Gradients: each rank's loss is pre-scaled by D so that FSDP2's mean over ranks is the single-process
gradient (collectives.data_parallel_scale); an expert's gradient sums the contributions of its
group's tokens, so before the optimizer steps it is divided by D and, with several groups, summed
across them (reduce_expert_gradients; not a hook on the parameter, which a model built on the meta
device and then materialised, as a sharded read does, would lose)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hybridflow.errors import UserError
from hybridflow.models.native.model import NativeModule
from hybridflow.models.native.moe import Experts


def apply_expert_parallel(model: NativeModule, mesh: DeviceMesh, size: int | None = None) -> NativeModule:
    """Split every MoE layer's experts of `model` in place over groups of `size` consecutive ranks of
    the 1-D data-parallel `mesh` (all of it by default; every rank holds the same whole model
    before); before FSDP2, which then leaves the experts alone."""
    dp, moe = mesh.size(), model.config.moe
    ep = size or dp
    if moe is None:
        raise UserError("expert parallelism needs a mixture-of-experts model; this one is dense")
    if moe.num_experts % ep:
        raise UserError(
            f"expert parallel size {ep} does not divide the model's num_experts={moe.num_experts}"
        )
    if dp % ep:
        raise UserError(f"expert parallel size {ep} does not divide the {dp} data-parallel ranks")
    if ep == dp:  # one group: the experts live on the data-parallel mesh itself
        grid, placements, group = mesh, [Shard(0)], mesh
    else:  # groups of ep consecutive ranks, each expert replicated across the groups
        grid = init_device_mesh(mesh.device_type, (dp // ep, ep), mesh_dim_names=("ep_replicas", "ep"))
        placements, group = [Replicate(), Shard(0)], grid["ep"]
    for module in model.modules():
        if isinstance(module, Experts):
            _split(module, grid, placements, group, dp)
    return model


def expert_parallel_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters apply_expert_parallel split (what FSDP2 must not shard again; experts that
    tensor parallelism split, parallel/tensor_moe.py, FSDP2 shards as any TP weight)."""
    return {
        p
        for module in model.modules()
        if isinstance(module, Experts) and getattr(module, "_expert_parallel", False)
        for p in module.parameters(recurse=False)
    }


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module) -> None:
    """Each split expert's gradient divided by the data-parallel size (see above) and, with several
    expert-parallel groups, summed across them (each group saw its own tokens). Every rank calls it
    after a mini-batch's backward passes, before the step; a no-op without split experts."""
    for module in model.modules():
        if not (isinstance(module, Experts) and getattr(module, "_expert_parallel", False)):
            continue
        for p in module.parameters(recurse=False):
            if p.grad is None:
                continue
            grad = p.grad.to_local()
            grad.div_(module._ep_data_parallel)
            if module._ep_replicas is not None:
                dist.all_reduce(grad, group=module._ep_replicas)


def _split(experts: Experts, grid: DeviceMesh, placements: list, group: DeviceMesh, dp: int) -> None:
    ep, rank = group.size(), group.get_local_rank()
    for name, weight in list(experts.named_parameters(recurse=False)):
        local = weight.detach().chunk(ep, dim=0)[rank].clone()  # [E/P, ...]
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, grid, placements, run_check=False)))
    experts._expert_parallel, experts._ep_data_parallel = True, dp
    experts._ep_replicas = grid["ep_replicas"].get_group() if grid.ndim == 2 else None
    experts.register_forward_pre_hook(_Dispatch(group).before, with_kwargs=False)
    experts.register_forward_hook(_Dispatch.after)


class _Dispatch:
    """The two exchanges around an Experts forward: rows to the experts' ranks before, results back
    after. What `after` needs of `before` (split sizes, the regrouping) rides on the module for the
    length of one forward."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.group, self.ep = mesh.get_group(), mesh.size()

    def before(self, module: Experts, args: tuple) -> tuple:
        inputs, counts = args  # [S, H] in expert order (all E experts), [E]
        ep, group = self.ep, self.group
        mine = counts.numel() // ep
        sent = counts.view(ep, mine)  # [P, E/P] rows for each rank's experts
        received = torch.empty_like(sent)  # [P, E/P] rows each rank sends to each of my experts
        dist.all_to_all_single(received, sent, group=group)
        send_splits, recv_splits = sent.sum(1).tolist(), received.sum(1).tolist()  # the host needs them
        rows = dist_nn.all_to_all_single(
            inputs.new_empty(sum(recv_splits), inputs.shape[1]), inputs, recv_splits, send_splits, group=group
        )  # [S', H] by sending rank, then by my expert
        expert_of_row = (
            torch.arange(mine, device=counts.device).repeat(ep).repeat_interleave(received.flatten())
        )
        order = torch.argsort(expert_of_row, stable=True)  # [S'] grouped by my expert
        module._ep_exchange = (order, send_splits, recv_splits, group)
        return rows.index_select(0, order), received.sum(0)

    @staticmethod
    def after(module: Experts, args: tuple, outputs: torch.Tensor) -> torch.Tensor:
        order, send_splits, recv_splits, group = module._ep_exchange
        del module._ep_exchange
        rows = args[0]
        if torch.is_grad_enabled() and not outputs.requires_grad:
            # no row reached this rank's experts, so nothing of theirs is in the graph; the exchange
            # back must be (or the other ranks' backward would wait for this one's forever), and the
            # experts need a gradient, zero, as the other ranks' have one (the norm, the optimizer)
            unused = sum(p.to_local().sum() for p in module.parameters(recurse=False) if p.requires_grad)
            outputs = outputs + rows + 0.0 * unused  # [0, H]
        by_sender = torch.empty_like(outputs).index_copy(0, order, outputs)  # back to arrival order
        return dist_nn.all_to_all_single(
            outputs.new_empty(sum(send_splits), outputs.shape[1]),
            by_sender,
            send_splits,
            recv_splits,
            group=group,
        )  # [S, H] in the order the rows were sent
