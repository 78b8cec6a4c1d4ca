"""Sampling from logits with per-sequence reproducible noise: Gumbel-max over temperature/top-k/top-p
warped logits. Returns the token, its log-prob under the sampling distribution and its log-prob
under the model's own (unscaled) distribution.

The noise of sequence s at generation step t for vocabulary entry j is a hash of (seed_s, t, j), so
a sequence samples the same tokens whatever else shares its batch and after a preemption.
"""

from __future__ import annotations

import torch

from hybridflow.rollout.sampling import SamplingParams, warp_logits

M31 = 0x7FFFFFFF
MIX = 0x45D9F3B  # small enough that (31-bit value) * MIX stays inside int64
GUMBEL_SPAN = 20.2  # > max - min of the Gumbel noise from 24-bit uniforms (17.33 + 2.86)


def mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of 31-bit values (int64 tensors) to 31-bit values."""
    x = (((x >> 16) ^ x) * MIX) & M31
    x = (((x >> 16) ^ x) * MIX) & M31
    return (x >> 16) ^ x


def step_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """seeds, steps [B] int64 -> per-row keys [B] of the step's noise."""
    return mix31(mix31(seeds & M31) ^ (steps & M31))


def sample(
    logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V]; seeds, steps [B] int64 -> token [B] int64, sampling log-prob [B], unscaled [B]."""
    if logits.is_cuda and not (0 < params.top_k < logits.shape[-1]) and params.top_p >= 1.0:
        from hybridflow.engine.triton_sampler import sample_triton

        return sample_triton(logits, params.temperature, step_keys(seeds, steps))
    return sample_reference(logits, params, seeds, steps)


def sample_reference(
    logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PyTorch path (CPU, top-k / top-p, and the Triton sampler's tests)."""
    logits = logits.float()
    unscaled = torch.log_softmax(logits, dim=-1)  # [B, V]
    if params.greedy:
        token = logits.argmax(dim=-1)
        lp = unscaled.gather(-1, token[:, None])[:, 0]
        return token, lp, lp
    warped = torch.log_softmax(warp_logits(logits, params), dim=-1)  # [B, V], -inf where removed
    # Gumbel-max: a draw from softmax(warped). The noise lies in [-2.86, 17.33] (24-bit uniforms), so
    # an entry more than GUMBEL_SPAN below its row's best cannot win: hash only the others (exact).
    rows, cols = (warped >= warped.max(dim=-1, keepdim=True).values - GUMBEL_SPAN).nonzero(as_tuple=True)
    keys = step_keys(seeds, steps)[rows]  # [K]
    bits = mix31(keys ^ cols) >> 7
    gumbel = -torch.log(-torch.log((bits.float() + 0.5) * (1.0 / (1 << 24))))
    scores = torch.full_like(warped, float("-inf"))
    scores[rows, cols] = warped[rows, cols] + gumbel
    token = scores.argmax(dim=-1)
    return token, warped.gather(-1, token[:, None])[:, 0], unscaled.gather(-1, token[:, None])[:, 0]
