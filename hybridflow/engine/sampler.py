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
# The noise's uniforms are (bits + 0.5) / 2^23 for 23 hash bits: all strictly inside (0, 1) in float32.
# (With 24 bits the largest, 1 - 2^-25, rounds to 1.0: its noise was +inf and its entry won whatever its
# logit, once in 2^24 entries: ~0.9% of all draws over a 152k vocabulary were uniform over the vocabulary.)
NOISE_BITS = 23
GUMBEL_SPAN = 20.2  # > max - min of the noise: 16.64 - (-2.81)


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


def gumbel_noise(keys: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The Gumbel noise of vocabulary entries `cols` under row keys `keys` (int64, broadcastable:
    [B, 1] with [V], or [K] with [K]) -> float32 of their broadcast shape: -log(-log(u)), u from the
    top NOISE_BITS bits of mix31(key ^ col). Computed in int32: the low 31 bits of an int32 product that wraps are
    those of the int64 product, so the bits are mix31's, at 1/10 of the time on a CPU without a
    vector 64-bit multiply (AVX2)."""
    x = torch.bitwise_xor(keys.to(torch.int32), cols.to(torch.int32))  # 31-bit values
    shifted = torch.empty_like(x)  # one scratch tensor, written in place (no allocation per op)
    for _ in range(2):
        x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted)).mul_(MIX).bitwise_and_(M31)
    x.bitwise_xor_(torch.bitwise_right_shift(x, 16, out=shifted))
    return gumbel_of_bits(torch.bitwise_right_shift(x, 31 - NOISE_BITS, out=shifted))


def gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """NOISE_BITS-bit integers -> their Gumbel noise -log(-log(u)), u = (bits + 0.5) / 2^NOISE_BITS
    (float32, in place of a scratch copy): finite for every value, in [-2.81, 16.64]."""
    return bits.float().add_(0.5).mul_(1.0 / (1 << NOISE_BITS)).log_().neg_().log_().neg_()


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
    plain = params.top_k <= 0 and params.top_p >= 1.0
    if plain and params.temperature == 1.0:
        warped = unscaled  # logits / 1 are the logits
    else:
        warped = torch.log_softmax(warp_logits(logits, params), dim=-1)  # [B, V], -inf where removed
    keys = step_keys(seeds, steps)  # [B]
    if plain:  # most entries can win: noise for all of them (cheaper than finding the candidates)
        cols = torch.arange(warped.shape[-1], device=warped.device)
        token = (warped + gumbel_noise(keys[:, None], cols)).argmax(dim=-1)
    else:
        # Gumbel-max: a draw from softmax(warped). The noise lies in [-2.81, 16.64] (gumbel_of_bits),
        # so an entry more than GUMBEL_SPAN below its row's best cannot win: noise for the others only
        rows, cols = (warped >= warped.max(dim=-1, keepdim=True).values - GUMBEL_SPAN).nonzero(as_tuple=True)
        scores = torch.full_like(warped, float("-inf"))
        scores[rows, cols] = warped[rows, cols] + gumbel_noise(keys[rows], cols)
        token = scores.argmax(dim=-1)
    return token, warped.gather(-1, token[:, None])[:, 0], unscaled.gather(-1, token[:, None])[:, 0]
