"""One call for every estimator: the controller's `advantages` step (pure function)."""

from __future__ import annotations

import torch

from hybridflow.algorithms.estimators import StepInputs, estimator
from hybridflow.config.schema import AlgorithmConfig


def token_level_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scores [B] placed on each response's last token the policy sampled (its last masked-in
    position: a multi-turn episode may end on a tool's or environment's tokens) -> [B, T]."""
    rewards = torch.zeros_like(mask)
    if mask.shape[1] == 0:
        return rewards
    positions = torch.arange(mask.shape[1], device=mask.device)  # [T]
    last = torch.where(mask > 0, positions, -1).amax(-1)  # [B], -1: no sampled token
    rows = torch.nonzero(last >= 0)[:, 0]
    rewards[rows, last[rows]] = scores[rows].float()
    return rewards


def compute_advantages(
    config: AlgorithmConfig,
    *,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    group_ids: list[int],
    values: torch.Tensor | None = None,
    baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [B, T] with the estimator named by `config.adv_estimator`. Outcome
    estimators use the sequence total of token rewards (score, minus any KL-in-reward penalty)."""
    inputs = StepInputs(token_rewards, mask, group_ids, values, baselines)
    return estimator(config.adv_estimator).compute(inputs, config)
