"""How old a step's tokens are: the async/* staleness metrics, and the gap scope of each token (which
policy and which K/V sampled it) for the rollout/trainer gap metrics."""

from __future__ import annotations

import torch

from hybridflow.batch import GapScope, Rollouts, pad_ragged


def staleness_metrics(rollouts: Rollouts, *, trained_by: int) -> dict[str, float]:
    """Per sampled token, how many updates older its policy is than the one training on it; the share
    of sequences continued across a weight update (two versions or more), and of sequences with any
    token older than the training policy."""
    ages = [trained_by - v for versions in rollouts.policy_versions for v in versions if v >= 0]
    mixed = sum(len({v for v in versions if v >= 0}) > 1 for versions in rollouts.policy_versions)
    stale = sum(any(0 <= v < trained_by for v in versions) for versions in rollouts.policy_versions)
    return {
        "async/staleness_mean": sum(ages) / max(len(ages), 1),
        "async/staleness_max": float(max(ages, default=0)),
        "async/partial_sequences": mixed / max(len(rollouts), 1),
        "async/stale_sequences": stale / max(len(rollouts), 1),
    }


def gap_scopes(
    rollouts: Rollouts, mask: torch.Tensor, *, trained_by: int | None, kv_kept: bool = False
) -> torch.Tensor:
    """[B, T] int8 GapScope of each response token (mask [B, T]) for the rollout/trainer gap metrics:
    FRESH where the training policy (version `trained_by`) sampled it over K/V of its own weights,
    the guard's numerics check, which older tokens' drift would trip; KEPT_KV where it sampled it over
    K/V kept from older weights (`kv_kept`, rollout.keep_kv_on_weight_update: a sequence continued
    across an update; what the kept K/V cost in off-policyness); COUNTED for older policies' tokens,
    and everywhere in a synchronous step (`trained_by` None: the whole batch's gap alone)."""
    counted = mask > 0  # [B, T]
    scopes = counted.to(torch.int8) * int(GapScope.COUNTED)
    if trained_by is None or rollouts.policy_versions is None:
        return scopes
    versions = pad_ragged([[float(v) for v in row] for row in rollouts.policy_versions], mask.shape[1])
    own = (versions == trained_by) & counted  # [B, T]
    if kv_kept:
        whole = torch.tensor(
            [all(v == trained_by for v in row if v >= 0) for row in rollouts.policy_versions],
            device=own.device,
        )[:, None]  # [B, 1]: sampled by that policy alone (-1: a tool's or template's token)
        scopes[own & ~whole] = int(GapScope.KEPT_KV)
        own &= whole
    scopes[own] = int(GapScope.FRESH)
    return scopes
