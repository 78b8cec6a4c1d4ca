"""Loss aggregation with explicit denominators, so a loss never depends on how the batch was split."""

from __future__ import annotations

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def count_tokens(mask: torch.Tensor) -> int:
    return int(mask.sum().item())


def count_sequences(mask: torch.Tensor) -> int:
    """Sequences with at least one masked-in token (an empty row never dilutes a mean)."""
    return int((mask.sum(-1) > 0).sum().item())


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    - token-mean:              sum_{b,t} m l / N_tokens
    - seq-mean-token-sum:      sum_b (sum_t m l) / N_seqs
    - seq-mean-token-mean:     sum_b (sum_t m l / sum_t m) / N_seqs
    - seq-mean-token-sum-norm: sum_b (sum_t m l / scale) / N_seqs   (Dr.GRPO; scale defaults to T,
                               pass a constant such as max_response_tokens to make it split-invariant)

    N_tokens / N_seqs default to this batch's counts; pass `global_tokens` / `global_seqs` (the counts
    over the whole mini-batch, all micro-batches and data-parallel ranks) and the sum of the pieces'
    losses equals the loss of the whole.
    """
    mask = mask.to(loss_mat.dtype)
    token_sum = (loss_mat * mask).sum(-1)  # [B]
    if mode == "token-mean":
        denom = count_tokens(mask) if global_tokens is None else global_tokens
        return token_sum.sum() / max(denom, 1)
    denom = count_sequences(mask) if global_seqs is None else global_seqs
    if mode == "seq-mean-token-sum":
        per_seq = token_sum
    elif mode == "seq-mean-token-mean":
        per_seq = token_sum / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = token_sum / (loss_mat.shape[-1] if scale is None else scale)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {', '.join(AGG_MODES)}")
    return per_seq.sum() / max(denom, 1)
