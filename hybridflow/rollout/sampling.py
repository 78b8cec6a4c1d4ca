"""Sampling parameters and the logit warping every backend applies the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class NonFiniteLogits(RuntimeError):
    """The model produced NaN/inf logits (typically: weights blown up by a too-high learning rate)."""


GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily (vLLM's rule): dividing logits by it overflows."""


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    max_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    """Generation stops after any of these (the tokenizer's EOS is always one)."""
    seed: int | None = None
    first_sequence: int = 0
    """Index of this call's first sequence in a larger request split over workers: the native engine
    draws sequence i from the stream (seed, first_sequence + i), so a split call samples exactly
    what the whole call would."""

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature={self.temperature}: give 0 (greedy) or more")
        if self.temperature < GREEDY_BELOW:  # 1 / t would overflow to inf and the draw to NaN
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Generation:
    """One sampled response."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    """Log-prob of each sampled token under the sampling distribution (after temperature/top-k/top-p)."""
    finish_reason: str
    """'stop' (a stop token was sampled; it ends token_ids) or 'length'."""
    unscaled_logprobs: list[float] | None = None
    """Log-prob of each sampled token under the model's own distribution (no temperature/top-k/top-p),
    where the backend reports it."""
    routed_experts: torch.Tensor | None = None
    """Mixture-of-experts models, where the engine records them: the experts every token of prompt
    and response but the last went to in every MoE layer, [tokens - 1, MoE layers, k] (router replay)."""


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k and top-p to logits [B, V]; removed tokens get -inf. Greedy: unchanged."""
    if params.greedy:
        return logits
    logits = logits.float() / params.temperature  # [B, V]
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p  # [B, V]
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
