"""Log-probs (and entropy) of target tokens without ever holding the [tokens, vocab] float32 matrix:
the LM head and log-softmax run over token chunks, forward and backward (a custom autograd function
that recomputes each chunk's logits in backward instead of storing them, and keeps each token's
log-sum-exp for it). On CUDA each chunk's softmax work is a Triton kernel (`triton_logprobs`)."""

from __future__ import annotations

import torch


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, scale: float, exact: bool = False):
    """One chunk's raw logits [c, V] (the matmul's dtype) and targets [c] -> log p(target), entropy and
    log-sum-exp [c] each, float32, of softmax(logits * scale). exact: the Triton kernel wherever it
    runs (a row per program: the engine's sampled log-probs come from it too)."""
    if logits.is_cuda or exact:
        from hybridflow.models.native.triton_logprobs import chunk_stats

        return chunk_stats(logits, targets, scale)
    logits = logits.float() * scale
    lse = torch.logsumexp(logits, -1)  # [c]
    logp = logits.gather(-1, targets[:, None])[:, 0] - lse
    entropy = lse - (torch.exp(logits - lse[:, None]) * logits).sum(-1)
    return logp, entropy, lse


def _chunk_grad(
    logits: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor, lse: torch.Tensor, scale: float
):
    """d loss / d raw logits [c, V] in the logits' dtype: (onehot(target) - softmax) * grad * scale,
    with the softmax from the forward's log-sum-exp (on CUDA written over the logits)."""
    if logits.is_cuda:
        from hybridflow.models.native.triton_logprobs import chunk_grad_

        return chunk_grad_(logits, targets, grad_logp, lse, scale)
    scaled = logits.float() * scale
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab[None, :] == targets[:, None]).float()  # [c, V]
    return ((onehot - torch.exp(scaled - lse[:, None])) * (grad_logp[:, None] * scale)).to(logits.dtype)


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk: int,
        scale: float,
        exact: bool,
    ):
        n = hidden.shape[0]
        w = weight.to(hidden.dtype)  # matmuls run in the activations' dtype (bf16 under autocast)
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N], for the backward
        if exact:
            from hybridflow.kernels.linear import linear

            w = w.contiguous()
        for s in range(0, n, chunk):
            rows = hidden[s : s + chunk]
            logits = linear(rows.contiguous(), w) if exact else rows @ w.T  # [c, V]
            logp[s : s + chunk], entropy[s : s + chunk], lse[s : s + chunk] = _chunk_stats(
                logits, targets[s : s + chunk], scale, exact
            )
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.scale = chunk, scale
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, lse = ctx.saved_tensors
        w = weight.to(hidden.dtype)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            if ctx.needs_input_grad[1]
            else None
        )
        for s in range(0, hidden.shape[0], ctx.chunk):
            h, rows = hidden[s : s + ctx.chunk], slice(s, s + ctx.chunk)
            # d logp_t / d logits = onehot(target) - softmax; the raw logits' gradient is that times scale
            d_logits = _chunk_grad(h @ w.T, targets[rows], grad_logp[rows].contiguous(), lse[rows], ctx.scale)
            if grad_hidden is not None:
                grad_hidden[s : s + ctx.chunk] = d_logits @ w
            if grad_weight is not None:
                grad_weight.add_(d_logits.T @ h)  # [V, H]: no float32 copy of the product
        return (
            grad_hidden,
            (grad_weight.to(weight.dtype) if grad_weight is not None else None),
            None,
            None,
            None,
            None,
        )


def chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int = 2048,
    temperature: float = 1.0,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], lm-head weight [V, H], targets [N] -> (log p(target) [N] float32, entropy [N]
    float32, no gradient) of softmax(logits / temperature). Peak extra memory: one [chunk, V] block of
    logits (on CUDA in the matmul's dtype; elsewhere a float32 copy too). Under autocast the matmuls run in the autocast dtype (the final norm hands over float32
    activations). exact: the LM head and softmax through the batch-invariant kernels (the engine's)."""
    from torch.distributed.tensor import DTensor

    if isinstance(weight, DTensor):  # a tensor-parallel head: each rank holds rows of the vocabulary
        from hybridflow.parallel.tensor import TP_MESH, vocab_parallel_logprobs

        if weight.device_mesh.mesh_dim_names != (TP_MESH,):  # an FSDP shard: other ranks hold other tokens
            raise ValueError(
                f"the LM head's weight is a DTensor on mesh {weight.device_mesh} rather than the "
                f"tensor-parallel mesh {TP_MESH!r}: gather it (run inside the model's FSDP forward method)"
            )
        return vocab_parallel_logprobs(hidden, weight, targets, chunk=chunk, temperature=temperature)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        hidden = hidden.to(torch.get_autocast_dtype(device))
    return _ChunkedLogProbs.apply(hidden, weight, targets, chunk, 1.0 / temperature, exact)
