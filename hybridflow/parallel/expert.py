"""Expert parallelism for the native model's mixture-of-experts layers, over the data-parallel group,
applied from outside like tensor parallelism (the model file stays single-device).

Each of the P ranks keeps E / P experts of every MoE layer (rank r experts r*E/P .. (r+1)*E/P - 1: a
DTensor sharded on the expert dimension, so FSDP2 leaves them alone and checkpoints, weight syncs and
exports see whole tensors). The rest of the model is FSDP2 as before. In a forward, each rank routes
its own tokens, sends each (token, choice) row to the rank holding its expert (one all-to-all of
[rows, H]), runs its experts on what it received, and sends the results back (a second all-to-all);
the backward runs the same exchanges in reverse. A rank never gathers another rank's experts.

Gradients: each rank's loss is pre-scaled by the data-parallel size so that FSDP2's mean over ranks
is the single-process gradient (collectives.data_parallel_scale); an expert's gradient is not
averaged but summed over the ranks whose tokens reached it, so it is divided by that size here."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hybridflow.errors import UserError
from hybridflow.models.native.model import NativeModule
from hybridflow.models.native.moe import Experts


def apply_expert_parallel(model: NativeModule, mesh: DeviceMesh) -> NativeModule:
    """Split every MoE layer's experts of `model` in place over the 1-D data-parallel `mesh` (every
    rank holds the same whole model before); before FSDP2, which then leaves the experts alone."""
    ep, moe = mesh.size(), model.config.moe
    if moe is None:
        raise UserError("expert parallelism needs a mixture-of-experts model; this one is dense")
    if moe.num_experts % ep:
        raise UserError(
            f"expert parallel size {ep} does not divide the model's num_experts={moe.num_experts}"
        )
    for module in model.modules():
        if isinstance(module, Experts):
            _split(module, mesh)
    return model


def expert_parallel_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters apply_expert_parallel split (what FSDP2 must not shard again)."""
    return {
        p
        for module in model.modules()
        if isinstance(module, Experts) and isinstance(module.gate_up_proj, DTensor)
        for p in module.parameters(recurse=False)
    }


def _split(experts: Experts, mesh: DeviceMesh) -> None:
    ep = mesh.size()
    for name, weight in list(experts.named_parameters(recurse=False)):
        local = weight.detach().chunk(ep, dim=0)[mesh.get_local_rank()].clone()  # [E/P, ...]
        param = nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False))
        param.register_hook(lambda grad, ep=ep: grad / ep)  # summed over the ranks' tokens: see above
        setattr(experts, name, param)
    experts.register_forward_pre_hook(_Dispatch(mesh).before, with_kwargs=False)
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
