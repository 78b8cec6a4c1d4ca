"""Metric helpers with verl's names, so dashboards compare across frameworks."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext

import torch

from hybridflow.batch import GapScope, Rollouts
from hybridflow.controller.perf import perf_metrics


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {
        f"{prefix}/mean": v.mean().item(),
        f"{prefix}/max": v.max().item(),
        f"{prefix}/min": v.min().item(),
        f"{prefix}/std": v.std().item() if v.numel() > 1 else 0.0,
    }


def masked_values(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return t[mask > 0]


def data_metrics(
    rollouts: Rollouts,
    scores: torch.Tensor,
    token_rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor | None,
) -> dict[str, float]:
    """critic/{score,rewards,advantages,returns,values}/*, response_length/*, prompt_length/*."""
    out = {}
    out |= stats("critic/score", scores)
    out |= stats("critic/rewards", (token_rewards * mask).sum(-1))
    out |= stats("critic/advantages", masked_values(advantages, mask))
    out |= stats("critic/returns", masked_values(returns, mask))
    if values is not None:
        out |= stats("critic/values", masked_values(values, mask))
    lengths = torch.tensor([len(r) for r in rollouts.response_ids], dtype=torch.float32)
    out |= stats("response_length", lengths)
    out["response_length/clip_ratio"] = sum(f == "length" for f in rollouts.finish_reasons) / max(
        len(rollouts), 1
    )
    out |= stats("prompt_length", torch.tensor([len(p) for p in rollouts.prompt_ids], dtype=torch.float32))
    if rollouts.agent_stats is not None:
        from hybridflow.agents.runner import agent_metrics

        out |= agent_metrics(rollouts)
    out["rollout/prompts"] = float(len(set(rollouts.group_ids)))
    out["rollout/responses"] = float(len(rollouts))
    return out


def probs_diff(
    logp_a: torch.Tensor, logp_b: torch.Tensor, mask: torch.Tensor, suffix: str = ""
) -> dict[str, float]:
    """training/rollout_probs_diff{suffix}_*: |p_rollout - p_trainer| over response tokens."""
    diff = (logp_a.exp() - logp_b.exp()).abs()[mask > 0]
    if diff.numel() == 0:
        return {}
    return {
        f"training/rollout_probs_diff{suffix}_max": diff.max().item(),
        f"training/rollout_probs_diff{suffix}_mean": diff.mean().item(),
        f"training/rollout_probs_diff{suffix}_std": diff.std().item() if diff.numel() > 1 else 0.0,
    }


def scoped_probs_diff(logp_a: torch.Tensor, logp_b: torch.Tensor, scopes: torch.Tensor) -> dict[str, float]:
    """probs_diff over every token counted (scopes [B, T] of GapScope), and over each narrower scope
    that has tokens (_fresh, _kept_kv)."""
    out = probs_diff(logp_a, logp_b, scopes > 0)
    for scope in (GapScope.FRESH, GapScope.KEPT_KV):
        out |= probs_diff(logp_a, logp_b, scopes == scope, scope.suffix)
    return out


class Timer:
    """Collects timing_s/{name} for the phases of one step."""

    def __init__(self, on_start=None, around=None) -> None:
        """`on_start(name)` hears of each phase as it begins (the progress bar shows it); each phase
        runs inside `around(name)` (the watchdog's)."""
        self.times: dict[str, float] = defaultdict(float)
        self.on_start = on_start
        self.around = around

    @contextmanager
    def __call__(self, name: str):
        if self.on_start is not None:
            self.on_start(name)
        start = time.perf_counter()
        try:
            with self.around(name) if self.around is not None else nullcontext():
                yield
        finally:
            self.times[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.times.items()}


def accuracy_at_n(scores: list[float], preds: list, n: int) -> dict[str, float]:
    """mean@N, best@N and maj@N of one prompt's N samples (maj: the most common non-empty answer,
    scored by any response that gave it; first seen wins a tie)."""
    counts = Counter(p for p in preds if p is not None)
    if counts:
        top = max(counts.values())
        winner = next(p for p in preds if p is not None and counts[p] == top)
        maj = scores[preds.index(winner)]
    else:
        maj = 0.0
    return {f"mean@{n}": sum(scores) / len(scores), f"best@{n}": max(scores), f"maj@{n}": maj}


def step_metrics(rollouts: Rollouts, scored, batch, token_rewards: torch.Tensor, timer: Timer, *, reward_s: float,
                 devices: int, shape, actor_passes: int, peak: float | None) -> dict[str, float]:  # fmt: skip
    """A step's data (scores, rewards [B, T], advantages, returns, values, lengths), timing and
    throughput metrics (verl's names); `reward_s`: the scoring that ran inside the gen phase."""
    metrics = data_metrics(rollouts, scored.raw_scores, token_rewards, batch.advantages, batch.returns,
                           batch.response_mask, batch.old_values)  # fmt: skip
    metrics |= timer.metrics()
    metrics["timing_s/gen"] -= reward_s
    metrics |= perf_metrics(
        timer.times,
        prompt_lengths=[len(p) for p in rollouts.prompt_ids],
        response_lengths=[len(r) for r in rollouts.response_ids],
        devices=devices,
        shape=shape,
        actor_passes=actor_passes,
        peak=peak,
    )
    return metrics
