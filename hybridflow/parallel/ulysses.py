"""Ulysses sequence parallelism for our packed model (`actor.sequence_parallel_size`): the ranks of
one sequence-parallel group share a micro-batch and each holds 1/P of its packed tokens through the
embedding, the norms and the MLPs. Attention needs whole sequences, so around it an all-to-all trades
the token split for a head split — every rank attends over all tokens with 1/P of the heads — and a
second all-to-all trades back. Activation memory per rank falls by P for long responses.

The backbone's final hidden states are gathered whole on every rank of the group, so the LM head,
log-probs and losses run unchanged (and redundantly) on each. Gradients: the gather's backward sums
the group's identical upstream gradients, so every parameter — layer or head — ends up with P times
its share, and the loss is scaled by the data-parallel size (world / P) instead of the world size
(`collectives.data_parallel_scale`) for FSDP2's average over all ranks to be the true gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridflow.errors import UserError
from hybridflow.parallel import collectives


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Chunk j of dim 0 goes to rank j; chunk j of the result came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too (empty_like keeps a transposed input's strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def _tokens_to_heads(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """[n, H, D] (this rank's tokens, all heads) -> [P n, H / P, D] (all tokens, this rank's heads)."""
    n, h, d = x.shape
    chunks = x.view(n, size, h // size, d).transpose(0, 1)  # [P, n, H/P, D]: chunk j for rank j
    return _all_to_all(chunks, group).reshape(size * n, h // size, d)


def _heads_to_tokens(x: torch.Tensor, size: int, group) -> torch.Tensor:
    """The inverse: [P n, H / P, D] -> [n, H, D]."""
    total, h, d = x.shape
    n = total // size
    back = _all_to_all(x.view(size, n, h, d), group)  # [P, n, H/P, D]: heads of rank j
    return back.transpose(0, 1).reshape(n, size * h, d)


class _Reshard(torch.autograd.Function):
    """`_tokens_to_heads` (or, `inverse`, `_heads_to_tokens`); the backward is the other one."""

    @staticmethod
    def forward(ctx, x, size, group, inverse: bool):
        ctx.size, ctx.group, ctx.inverse = size, group, inverse
        return (_heads_to_tokens if inverse else _tokens_to_heads)(x, size, group)

    @staticmethod
    def backward(ctx, grad):
        back = _tokens_to_heads if ctx.inverse else _heads_to_tokens
        return back(grad, ctx.size, ctx.group), None, None, None


class _GatherTokens(torch.autograd.Function):
    """[n, H] per rank -> [P n, H] on every rank; backward sums the ranks' gradients (gloo has no
    reduce-scatter: an all-reduce, then this rank's rows)."""

    @staticmethod
    def forward(ctx, x, size, rank, group):
        ctx.rows, ctx.group = slice(rank * x.shape[0], (rank + 1) * x.shape[0]), group
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rows], None, None, None


@dataclass
class SequenceParallel:
    """This rank's sequence-parallel group: `size` ranks that split each packed micro-batch."""

    group: object
    size: int
    rank: int  # within the group

    def split(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor):
        """Pad the packed stream [N] to a multiple of P (the padding is one extra sequence) and keep
        this rank's contiguous 1/P: (local ids [n], local positions [n], cu_seqlens of the padded
        stream). Attention sees the whole padded stream after its all-to-all."""
        total = input_ids.shape[0]
        pad = -total % self.size
        if pad:
            input_ids = F.pad(input_ids, (0, pad))
            position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)])
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([total + pad])])
        n = (total + pad) // self.size
        local = slice(self.rank * n, (self.rank + 1) * n)
        return input_ids[local], position_ids[local], cu_seqlens

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, attend):
        """`attend(q, k, v, layout)` over all tokens with 1/P of the heads. q [n, Hq, D], k/v
        [n, Hkv, D] (this rank's tokens) -> [n, Hq, D]."""
        if k.shape[1] % self.size:  # too few KV heads to split: give every query head its own
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        q, k, v = (_Reshard.apply(t, self.size, self.group, False) for t in (q, k, v))
        return _Reshard.apply(attend(q, k, v, layout), self.size, self.group, True)

    def gather(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """This rank's final hidden states [n, H] -> the whole unpadded stream [total, H]."""
        return _GatherTokens.apply(x, self.size, self.rank, self.group)[:total]


def init_sequence_parallel(size: int) -> SequenceParallel | None:
    """Split the ranks into groups of `size` consecutive ranks (every rank must call this); None
    for size 1."""
    if size == 1:
        return None
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % size:
        raise UserError(f"actor.sequence_parallel_size={size} must divide the number of workers ({world})")
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
    collectives.set_sequence_parallel_size(size)
    return SequenceParallel(groups[rank // size], size, rank % size)


def apply_sequence_parallel(model, sp: SequenceParallel) -> None:
    """Run `model`'s backbone (ours) sequence-parallel over `sp`'s group."""
    heads = model.config.num_attention_heads
    if heads % sp.size:
        raise UserError(
            f"actor.sequence_parallel_size={sp.size} must divide the model's {heads} attention heads"
        )
    model.model.sequence_parallel = sp
