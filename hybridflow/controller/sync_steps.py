"""The synchronous step's generation (trainer.async_mode=off): sample the step's prompts and score
them, DAPO's rounds of dynamic sampling, ReMax's greedy baselines. `trainer` is the RLTrainer."""

from __future__ import annotations

import logging

import torch

from hybridflow.algorithms.losses import filter_zero_variance_groups
from hybridflow.batch import Rollouts
from hybridflow.roles.reward import RewardResult

log = logging.getLogger(__name__)


def generate_step(trainer) -> tuple[Rollouts, RewardResult, dict[str, float]]:
    """Sample and score; with DAPO dynamic sampling, keep only informative groups and sample more
    prompts until the step has prompts_per_step of them or max_generation_rounds is reached."""
    c = trainer.config
    dapo = c.algorithm.filter_groups
    kept_rollouts, kept_results, groups, rounds, reward_time = [], [], 0, 0, 0.0
    round_rollouts, round_results = [], []  # unfiltered rounds, the fallback when nothing is informative
    while True:
        rounds += 1
        prompts = trainer.sampler.next(dapo.prompts_per_round if dapo.enable else None)
        rollouts = trainer.roles.rollouts(prompts, trainer.sampling(rounds), first_group=groups)
        with trainer.watchdog.phase("reward"):
            result: RewardResult = trainer.reward.score(rollouts)
        metrics = {k: v for k, v in result.metrics.items() if not k.startswith("timing_s/")}
        reward_time = result.metrics["timing_s/reward"] + (reward_time if rounds > 1 else 0.0)
        metrics["timing_s/reward"] = reward_time
        if not dapo.enable:
            return rollouts, result, metrics
        round_rollouts.append(rollouts)
        round_results.append(result)
        keep = filter_zero_variance_groups(filter_values(c, result), rollouts.group_ids)
        keep = keep.nonzero()[:, 0].tolist()
        kept_rollouts.append(rollouts.select(keep))
        kept_results.append(result.select(keep))
        groups += len(prompts)
        informative = len({g for r in kept_rollouts for g in r.group_ids})
        if informative >= c.data.prompts_per_step or rounds >= dapo.max_generation_rounds:
            break
    rollouts, result = Rollouts.concat(kept_rollouts), RewardResult.concat(kept_results)
    wanted = sorted(set(rollouts.group_ids))[: c.data.prompts_per_step]
    rows = [i for i, g in enumerate(rollouts.group_ids) if g in set(wanted)]
    if not rows:  # every group agreed (e.g. a solved task): train on the last round, whose advantages are 0
        log.warning("DAPO: no group with differing scores in %d rounds; this step carries no signal", rounds)
        rollouts, result = round_rollouts[-1], round_results[-1]
        rows = list(range(len(rollouts)))
    metrics |= {"dapo/generation_rounds": float(rounds), "dapo/kept_groups": float(len(wanted))}
    return rollouts.select(rows), result.select(rows), metrics


def filter_values(config, result: RewardResult) -> torch.Tensor:
    """[B] what must differ within a group for DAPO to keep it (algorithm.filter_groups.metric)."""
    metric = config.algorithm.filter_groups.metric  # seq_final_reward = seq_reward (start checks)
    return {"acc": result.accs, "score": result.raw_scores}.get(metric, result.scores)


def greedy_baselines(trainer, rollouts: Rollouts) -> torch.Tensor:
    """ReMax: the reward of one greedy response per prompt, broadcast to its samples."""
    firsts = {g: i for i, g in reversed(list(enumerate(rollouts.group_ids)))}
    prompts = [rollouts.prompts[i] for i in firsts.values()]
    greedy = trainer.roles.rollouts(prompts, trainer.sampling(0, n=1, temperature=0.0))
    with trainer.watchdog.phase("reward"):
        scores = trainer.reward.score(greedy).scores
    by_group = dict(zip(firsts, scores.tolist()))
    return torch.tensor([by_group[g] for g in rollouts.group_ids])
