"""Tensor parallelism of the native model's mixture-of-experts layers (applied by parallel/tensor.py's
plan, in training and in the engine's copy alike).

The tokens reaching an MoE layer are the same on every rank of a tensor-parallel group (the attention
before it ends in an all-reduce), so the group splits the experts instead of each expert's channels:
rank r of T keeps experts r*E/T .. (r+1)*E/T - 1 whole (a DTensor sharded on the expert dimension, as
a column-parallel weight is on its rows, so FSDP2 over a (dp, tp) mesh, weight syncs, checkpoints and
exports see whole tensors), runs the (token, choice) rows routed to them, and one all-reduce of [N, H]
sums the ranks' weighted outputs, the cost of a row-parallel projection. Nothing is sent between ranks
before the experts (unlike expert parallelism over data-parallel ranks, parallel/expert.py, whose
tokens differ per rank), and no count is read by the host, so the engine's decode steps stay capturable.

Gradients: the router and everything before it run the same on every rank, so each rank's backward
must see the whole gradient of the routing weights and of the experts' input, where its own experts
contribute only their rows': both are summed over the group in the backward (the identity-forward,
all-reduce-backward operator of Megatron's column-parallel input); the output's all-reduce passes its
gradient through unchanged."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from hybridflow.models.native.moe import SparseMoE


class TensorParallelMoE(SparseMoE):
    """A SparseMoE whose experts are split over a tensor-parallel mesh; the same parameter names."""

    def __init__(self, block: SparseMoE, mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)  # the block's own router and experts, not new ones
        self.gate, self.experts = block.gate, block.experts
        self.top_k, self.norm_topk_prob, self.num_experts = (
            block.top_k,
            block.norm_topk_prob,
            block.num_experts,
        )
        self.record_routing, self.routing = block.record_routing, None
        tp, rank = mesh.size(), mesh.get_local_rank()
        self.local_experts = block.num_experts // tp
        self.first_expert = rank * self.local_experts
        self.group = mesh.get_group()
        for name, weight in list(self.experts.named_parameters(recurse=False)):
            local = weight.detach().chunk(tp, dim=0)[rank].clone()  # [E/T, ...]
            dtensor = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(self.experts, name, nn.Parameter(dtensor, requires_grad=weight.requires_grad))

    def mix(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [N, H], weights and chosen [N, k] (the same on every rank) -> [N, H], summed over the
        group's experts."""
        x = _SumGradients.apply(x, self.group)
        weights = _SumGradients.apply(weights, self.group)
        mine = self.local_experts
        slots = chosen.flatten() - self.first_expert  # [N*k] each (token, choice)'s expert, locally
        held = (slots >= 0) & (slots < mine)  # [N*k] routed to one of this rank's experts
        key = torch.where(held, slots, mine)  # the other ranks' rows sort after this rank's, as one block
        order = torch.argsort(key, stable=True)
        tokens = order // self.top_k  # [N*k] the token each sorted row reads
        counts = torch.zeros(mine + 1, dtype=torch.int64, device=x.device)
        counts = counts.scatter_add_(0, key, torch.ones_like(key))[:mine]  # [E/T] rows per local expert
        keep = held[order, None]  # [N*k, 1]
        # the rows past this rank's blocks are not computed: zeroed going in (so no gradient of theirs
        # reaches x) and coming out
        rows = torch.where(keep, x.index_select(0, tokens), 0.0)
        computed = self.experts(rows, counts)  # [N*k, H], valid on this rank's rows
        if torch.is_grad_enabled() and not computed.requires_grad:
            # no row reached this rank's experts (the per-expert loop then touched neither them nor
            # the rows): the input's backward must still run (its all-reduce, which the other ranks
            # join, would wait forever), and the experts get a gradient, zero, as the other ranks'
            # do (the optimizers, FSDP2's reductions)
            computed = computed + 0.0 * rows
            if self.experts.gate_up_proj.requires_grad:
                unused = sum(p.to_local().sum() for p in self.experts.parameters(recurse=False))
                computed = computed + 0.0 * unused.to(computed.dtype)
        outputs = torch.where(keep, computed, 0.0)
        scaled = outputs * weights.flatten()[order, None].to(outputs.dtype)
        partial = torch.zeros_like(x).index_add_(0, tokens, scaled)  # [N, H] this rank's experts' share
        return _SumOutputs.apply(partial, self.group)


class _SumGradients(torch.autograd.Function):
    """Identity forward; the gradient summed over the group (each rank's experts saw their rows only)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutputs(torch.autograd.Function):
    """The ranks' partial outputs summed; the gradient, the same on every rank, passes unchanged."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        dist.all_reduce(partial, group=group)  # in place: a fresh tensor nothing else saved
        ctx.mark_dirty(partial)
        return partial

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
