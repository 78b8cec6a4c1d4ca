"""Tensor parallelism for the native model, applied from outside by a plan (the model file stays
single-device; torchtitan's approach), over DTensor, so that it composes with FSDP2.

Per decoder layer: q/k/v and gate/up column-parallel (each rank holds heads / tp query and KV
heads and intermediate / tp channels), o and down row-parallel (one all-reduce each, so two per
layer forward, and two backward: each group's input gradient is summed once, at its norm); the
attention module is told its local head counts. The embedding is vocabulary-parallel (each rank
looks up its rows, one all-reduce), and so is the LM head: `vocab_parallel_logprobs`
computes log-probs and entropy from each rank's [tokens, vocab / tp] logits with three all-reduces of
[tokens] vectors per chunk, never gathering the vocabulary. Norms and RoPE are replicated.

Used by actor.tensor_parallel_size (controller/worker_models.py: FSDP2 over a (dp, tp) mesh) and by the
engine's copy (engine/tensor_parallel.py: the same plan, so a trainer's TP shard is an engine's TP
shard). Mixture-of-experts layers split their experts whole over the ranks (parallel/tensor_moe.py).
Not here yet: sequence-parallel norms."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from hybridflow.errors import UserError
from hybridflow.models.native.model import NativeCausalLM, NativeModule
from hybridflow.models.native.moe import SparseMoE
from hybridflow.parallel.tensor_moe import TensorParallelMoE

TP_MESH = "tp"  # the name of the tensor-parallel mesh: a DTensor head on it is vocabulary-parallel


def apply_tensor_parallel(model: NativeModule, mesh: DeviceMesh) -> NativeModule:
    """Shard `model` in place over the 1-D `mesh` named TP_MESH (every rank holds the same full model
    before). A causal LM's head is split over the vocabulary; a score model's (the critic's value
    head, a few outputs) stays whole on every rank."""
    if mesh.mesh_dim_names != (TP_MESH,):
        raise ValueError(f"tensor parallelism runs over a 1-D mesh named {TP_MESH!r}, not {mesh}")
    c, tp = model.config, mesh.size()
    dense_mlps = c.moe is None or len(c.moe.sparse_layers) < c.num_hidden_layers
    for name, value in (
        ("num_attention_heads", c.num_attention_heads),
        ("num_key_value_heads", c.num_key_value_heads),
        ("intermediate_size", c.intermediate_size if dense_mlps else 0),
        ("num_experts", c.moe.num_experts if c.moe is not None else 0),
    ):
        if value % tp:
            raise UserError(f"tensor parallel size {tp} does not divide the model's {name}={value}")
    # The norm before a group of column-parallel projections hands them one replicated DTensor: their
    # input gradients then add up as partial DTensors and are all-reduced once, at the norm's output,
    # instead of once per projection (q/k/v: 3 -> 1 a layer in the backward, gate/up: 2 -> 1)
    shared_input = PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Replicate(), use_local_output=False
    )
    attention = {
        "input_layernorm": shared_input,
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
    }
    mlp = {
        "post_attention_layernorm": shared_input,
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoE):  # its experts split whole over the ranks (tensor_moe.py)
            parallelize_module(layer, mesh, attention)
            layer.mlp = TensorParallelMoE(layer.mlp, mesh)
        else:
            parallelize_module(layer, mesh, attention | mlp)
        layer.self_attn.heads //= tp  # the views of q/k/v see this rank's heads
        layer.self_attn.kv_heads //= tp
        if layer.self_attn.q_norm is not None:  # Qwen3's, over each head: a weight shared by the heads
            # of every rank, its input [N, heads/tp, D] sharded on the heads: DTensor sums the
            # ranks' gradients
            heads = SequenceParallel(sequence_dim=1, use_local_output=True)
            parallelize_module(layer.self_attn, mesh, {"q_norm": heads, "k_norm": heads})
    # vocabulary-parallel: rows of the embedding (a tied head shares them), the head's output channels
    parallelize_module(model.model, mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if not isinstance(model, NativeCausalLM):
        return model
    if c.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    return model


def local_part(source: torch.Tensor, target: DTensor) -> torch.Tensor:
    """This rank's part of `source` as `target` places it on its 1-D mesh: `source` whole (a trainer's
    gathered tensor: sliced here, nothing sent) or a DTensor (placed alike: its local part, nothing
    sent; else gathered first)."""
    if isinstance(source, DTensor):
        if source.placements == target.placements and source.device_mesh == target.device_mesh:
            return source.to_local()
        source = source.full_tensor()
    (placement,) = target.placements
    if isinstance(placement, Shard):  # Shard splits as torch.chunk: ceil-sized leading parts
        mesh = target.device_mesh
        return source.chunk(mesh.size(), placement.dim)[mesh.get_local_rank()]
    return source


def full_logits(model: NativeCausalLM, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] -> logits [N, V] gathered from every rank's vocabulary shard (tests, small
    inputs; training uses vocab_parallel_logprobs)."""
    weight = model.lm_head.weight
    if not isinstance(weight, DTensor):
        return model.lm_head(hidden)
    local = hidden @ weight.to_local().to(hidden.dtype).T  # [N, V/tp]
    shape = (hidden.shape[0], weight.shape[0])  # given: the shards may be uneven
    return DTensor.from_local(
        local, weight.device_mesh, [Shard(1)], shape=shape, stride=(shape[1], 1)
    ).full_tensor()


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: DTensor,
    targets: torch.Tensor,
    *,
    chunk: int = 2048,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked_token_logprobs with the LM head's weight [V, H] sharded over vocabulary rows:
    hidden [N, H] and targets [N] (the same on every rank) -> log p(target) [N] and entropy [N],
    float32, the same on every rank. Gradients of both (the entropy's too, unlike the one-process
    function's) reach `hidden` (summed over ranks) and each rank's rows of the weight."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        hidden = hidden.to(torch.get_autocast_dtype(device))
    mesh = weight.device_mesh
    vocab = weight.shape[0]
    rows = -(-vocab // mesh.size())  # Shard(0) splits as torch.chunk: ceil-sized leading shards
    first = mesh.get_local_rank() * rows
    return _VocabParallel.apply(
        hidden, weight.to_local(), targets, first, mesh.get_group(), chunk, 1.0 / temperature
    )


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, first: int, group, chunk: int, scale: float):
        n, rows = hidden.shape[0], weight.shape[0]
        w = weight.to(hidden.dtype)
        mine = (targets >= first) & (targets < first + rows)  # [N] targets in this rank's rows
        local = torch.where(mine, targets - first, 0)  # [N]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        mean_z = torch.empty_like(logp)  # E_p[z], the entropy's gradient needs it
        for s in range(0, n, chunk):
            part = slice(s, s + chunk)
            logits = (hidden[part] @ w.T).float() * scale  # [c, V/tp]
            peak = logits.max(-1).values  # [c]
            dist.all_reduce(peak, dist.ReduceOp.MAX, group=group)
            shifted = torch.exp(logits - peak[:, None])  # [c, V/tp]
            # [3, c]: sum of exp, sum of exp x logit, the target's logit (on the rank that holds it)
            sums = torch.stack(
                [
                    shifted.sum(-1),
                    (shifted * logits).sum(-1),
                    torch.where(mine[part], logits.gather(-1, local[part, None])[:, 0], 0.0),
                ]
            )
            dist.all_reduce(sums, group=group)
            lse[part] = peak + torch.log(sums[0])
            logp[part] = sums[2] - lse[part]
            mean_z[part] = sums[1] / sums[0]
            entropy[part] = lse[part] - mean_z[part]
        ctx.save_for_backward(hidden, weight, local, mine, lse, mean_z)
        ctx.group, ctx.chunk, ctx.scale = group, chunk, scale
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local, mine, lse, mean_z = ctx.saved_tensors
        w = weight.to(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        for s in range(0, hidden.shape[0], ctx.chunk):
            part = slice(s, s + ctx.chunk)
            h, g = hidden[part], grad_logp[part].float()
            z = (h @ w.T).float() * ctx.scale  # [c, V/tp] scaled logits
            p = torch.exp(z - lse[part, None])
            # d logp / dz = onehot(target) - p; d entropy / dz = -p (z - E_p[z]); over this rank's columns
            d_logits = -p * g[:, None]
            rows = torch.arange(h.shape[0], device=h.device)
            d_logits[rows, local[part]] += torch.where(mine[part], g, 0.0)  # the target, where held
            if grad_entropy is not None:
                d_logits -= p * (z - mean_z[part, None]) * grad_entropy[part, None].float()
            d_logits = (d_logits * ctx.scale).to(h.dtype)
            grad_hidden[part] = d_logits @ w
            grad_weight.add_(d_logits.T @ h)  # [V, H]: no float32 copy of the product
        dist.all_reduce(grad_hidden, group=ctx.group)  # every rank's columns add to d hidden
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None
