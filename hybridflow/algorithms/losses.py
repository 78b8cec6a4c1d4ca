"""Losses and loss-side helpers: aggregation, KL terms, policy and value losses, entropy,
truncated importance sampling, DAPO's overlong shaping and group filter.

The policy-loss variants live in policy_losses.py, KL estimators and controllers in kl.py and
aggregation in aggregation.py; this module is the one place to import them from.
"""

from __future__ import annotations

import torch

from hybridflow.algorithms.advantages import Groups, group_stats, masked_mean
from hybridflow.algorithms.aggregation import AGG_MODES, aggregate, count_sequences, count_tokens
from hybridflow.algorithms.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from hybridflow.algorithms.policy_losses import POLICY_LOSSES, policy_loss

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "count_sequences",
    "count_tokens",
    "entropy_from_logits",
    "entropy_from_logits_chunked",
    "filter_zero_variance_groups",
    "kl_penalty",
    "overlong_penalty",
    "policy_loss",
    "truncated_importance_weights",
    "value_loss",
]


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip: float = 0.5,
    agg: str = "token-mean",
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO): 0.5 agg(max((v - R)^2, (clip(v, v_old +- clip) - R)^2)).
    Metrics: vf_clipfrac (fraction of tokens where the clipped term is larger)."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)  # [B, T]
    loss1 = (values - returns) ** 2
    loss2 = (clipped - returns) ** 2
    mask = response_mask.to(values.dtype)
    loss = 0.5 * aggregate(
        torch.maximum(loss1, loss2), mask, agg, global_tokens=global_tokens, global_seqs=global_seqs
    )
    return loss, {"vf_clipfrac": masked_mean((loss2 > loss1).float(), mask).detach()}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum softmax(z) z over the last dim, in float32. [..., V] -> [...]."""
    z = logits.float()
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy over row chunks: forward and backward each hold one [chunk, V] float32 block at a time.

    dH/dz_j = -p_j (log p_j + H), recomputed per chunk in backward instead of being stored.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)  # [N]
        for start in range(0, logits.shape[0], chunk_rows):
            out[start : start + chunk_rows] = entropy_from_logits(logits[start : start + chunk_rows])
        ctx.save_for_backward(logits, out)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)  # [N, V] in the logits' dtype
        for start in range(0, logits.shape[0], ctx.chunk_rows):
            sl = slice(start, start + ctx.chunk_rows)
            logp = torch.log_softmax(logits[sl].float(), -1)  # [n, V]
            g = -logp.exp() * (logp + entropy[sl, None]) * grad_out[sl, None]
            grad[sl] = g.to(grad.dtype)
        return grad, None


def entropy_from_logits_chunked(logits: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """Entropy of each row of logits [N, V] -> [N] float32, never holding [N, V] float32 at once
    (forward or backward)."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _ChunkedEntropy.apply(flat, chunk_rows).reshape(logits.shape[:-1])


def truncated_importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> torch.Tensor:
    """Truncated IS weights [B, T] correcting rollout/trainer mismatch (Yao et al. 2025, "TIS"):
    token: min(exp(old - rollout), cap); sequence: min(exp(sum_t (old - rollout)), cap) on every token.
    Detached; zero outside the mask."""
    mask = response_mask.to(old_logp.dtype)
    log_w = (old_logp - rollout_logp).detach() * mask  # [B, T]
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    elif level != "token":
        raise ValueError(f"unknown importance-sampling level {level!r}; use 'token' or 'sequence'")
    return torch.exp(torch.clamp(log_w, -20, 20)).clamp(max=cap) * mask


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_tokens: int, buffer_tokens: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment [B]: 0 up to max - buffer tokens, then falling linearly to
    -factor at max tokens: min(-(L - (max - buffer)) / buffer * factor, 0)."""
    expected = max_response_tokens - buffer_tokens
    exceed = response_lengths.float() - expected
    return torch.clamp(-exceed / buffer_tokens * factor, max=0.0)


def filter_zero_variance_groups(scores: torch.Tensor, group_ids: Groups) -> torch.Tensor:
    """DAPO dynamic sampling: keep [B] bool — False for samples whose group's scores all agree
    (they carry no GRPO signal). Groups of one are kept (verl's rule)."""
    _, std, count = group_stats(scores, group_ids)
    return (std > 0) | (count == 1)
