"""Pure pieces of a step between the rollouts and the updates: the training batch made of a step's
rollouts, the KL penalty folded into the reward, and the router-replay and bypass-mode metrics."""

from __future__ import annotations

import torch

from hybridflow.algorithms.kl import kl_penalty
from hybridflow.batch import Rollouts, TrainingBatch, pad_ragged
from hybridflow.config import Config
from hybridflow.stream.admission import max_staleness
from hybridflow.stream.staleness import gap_scopes


def training_batch(config: Config, rollouts: Rollouts, *, step: int) -> TrainingBatch:
    """The step's rollouts as the roles train on them: [B, T] response mask (1 on the tokens the
    policy sampled), the sampler's log-probs, recorded routes, and each token's gap scope."""
    mask = pad_ragged(rollouts.masks())  # [B, T]
    return TrainingBatch(
        rollouts.prompt_ids,
        rollouts.response_ids,
        mask,
        rollout_logprobs=pad_ragged(rollouts.response_logprobs, mask.shape[1]),
        routed_experts=rollouts.routed_experts,
        gap_scopes=gap_scopes(  # [B, T]: the gap metric each token counts in
            rollouts,
            mask,
            trained_by=step - 1 if max_staleness(config) > 0 else None,
            kv_kept=config.rollout.keep_kv_on_weight_update,
        ),
    )


def sampled_routes_metrics(config: Config, rollouts: Rollouts) -> dict[str, float]:
    """R3: the share of samples whose routes the engine recorded (1 unless it kept none for some)."""
    if config.actor.router_replay != "R3":
        return {}
    routes = rollouts.routed_experts or [None] * len(rollouts)
    return {"router_replay/recorded_fraction": sum(r is not None for r in routes) / len(routes)}


def kl_in_reward(
    config: Config, token_rewards: torch.Tensor, batch: TrainingBatch, kl_ctl
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_rewards [B, T] less kl_ctl's coefficient times the per-token KL of pi_old to the
    reference (algorithm.kl_penalty); the controller then adapts its coefficient to this step's KL."""
    mask = batch.response_mask  # [B, T]
    kl = kl_penalty(batch.old_logprobs, batch.ref_logprobs, config.algorithm.kl_penalty) * mask  # [B, T]
    current = (kl.sum() / mask.sum().clamp(min=1)).item()
    metrics = {"actor/reward_kl_penalty": current, "actor/reward_kl_penalty_coeff": kl_ctl.value}
    penalized = token_rewards - kl_ctl.value * kl
    kl_ctl.update(current, n_steps=config.data.prompts_per_step)
    return penalized, metrics


def actor_update_metrics(config: Config, metrics: dict[str, float]) -> dict[str, float]:
    """The update's metrics; in bypass mode pi_old is the sampler's own, so the first mini-batch's KL
    is its gap to the trainer (and its age), not the recomputation bug trainer.guards.max_first_ppo_kl
    looks for: renamed training/first_minibatch_ppo_kl_to_rollout."""
    if config.algorithm.rollout_correction.bypass_mode and "training/first_minibatch_ppo_kl" in metrics:
        metrics["training/first_minibatch_ppo_kl_to_rollout"] = metrics.pop("training/first_minibatch_ppo_kl")
    return metrics
