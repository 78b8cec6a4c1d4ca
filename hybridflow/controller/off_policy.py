"""pi_old for the PPO ratio, and the corrections between the policy that sampled the batch and the one
that trains on it (algorithm.rollout_correction): one place for the choice the step makes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridflow.algorithms.rollout_correction import importance_weights, rejection_mask
from hybridflow.batch import GapScope, TrainingBatch
from hybridflow.config import Config
from hybridflow.controller.metrics import scoped_probs_diff
from hybridflow.stream.admission import max_staleness


def needs_old_logprobs(c: Config, batch_size: int, *, stale: bool) -> bool:
    """Whether pi_old must exist apart from the update's own first forward: several updates per step
    (PPO epochs, mini-batches), a KL penalty in the reward, a correction, or a batch sampled by an
    older policy (an asynchronous run)."""
    on_policy = (c.actor.sequences_per_update or batch_size) >= batch_size and c.actor.ppo_epochs == 1
    return not on_policy or stale or c.algorithm.use_kl_in_reward or c.algorithm.rollout_correction.enabled


def engine_is_pi_old(c: Config, batch: TrainingBatch) -> bool:
    """rollout.exact_logprobs, and the policy about to train sampled every token over its own K/V: the
    engine's log-probs are the trainer's to the bit, so they are pi_old (nothing to recompute; the
    rollout corrections are exactly 1). A batch with older policies' tokens is recomputed as ever."""
    if not c.rollout.exact_logprobs or batch.rollout_logprobs is None:
        return False
    if max_staleness(c) == 0:
        return True
    return bool((batch.gap_scopes[batch.response_mask > 0] == GapScope.FRESH).all())


def set_old_logprobs(
    c: Config, batch: TrainingBatch, recompute: Callable[[TrainingBatch], torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Fills batch.old_logprobs (and importance_weights); returns the actor's loss mask [B, T] (the
    response mask less rejected tokens) and the correction's metrics, with the rollout/trainer gap
    over batch.gap_scopes where pi_old is recomputed (in bypass mode the update's forward measures it)."""
    corr, mask = c.algorithm.rollout_correction, batch.response_mask
    # bypass: two policies, the PPO ratio against the sampler itself; exact: the sampler's are the bits
    # a recompute would give. Either way the update's first forward measures the gap (gap_scopes kept)
    if corr.bypass_mode or engine_is_pi_old(c, batch):
        batch.old_logprobs = batch.rollout_logprobs
        return mask, {}
    batch.old_logprobs = recompute(batch)
    metrics = scoped_probs_diff(batch.rollout_logprobs, batch.old_logprobs, batch.gap_scopes)
    batch.gap_scopes = None  # measured here: the update's forward need not again
    if not corr.enabled:
        return mask, metrics
    log_ratio = (batch.old_logprobs - batch.rollout_logprobs) * mask  # [B, T]
    metrics["rollout_corr/log_ratio_mean"] = (log_ratio.sum() / mask.sum().clamp(min=1)).item()
    if corr.rollout_is is not None:
        batch.importance_weights, m = importance_weights(
            batch.old_logprobs,
            batch.rollout_logprobs,
            mask,
            level=corr.rollout_is,
            threshold=corr.rollout_is_threshold,
            batch_normalize=corr.rollout_is_batch_normalize,
        )
        metrics |= m
    if corr.rollout_rs is not None:
        mask, m = rejection_mask(log_ratio, mask, corr.rollout_rs, corr.rollout_rs_threshold)
        metrics |= m
    return mask, metrics
