"""Admission rules, as small policies over the stream of groups: how far ahead of the trainer groups
may start (bounded staleness, 0 = synchronous), how a step refills itself when DAPO filters groups
out, and ReMax's greedy baseline group. Each works the same over every source of batches
(stream/batches.py): `generate(prompts, params)` and `score(rollouts)` are the source's own."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from hybridflow.algorithms.losses import filter_zero_variance_groups
from hybridflow.batch import Prompt, Rollouts
from hybridflow.config import Config
from hybridflow.roles.reward import RewardResult
from hybridflow.rollout.sampling import SamplingParams

log = logging.getLogger(__name__)

Generate = Callable[[list[Prompt], SamplingParams], Rollouts]
Score = Callable[[Rollouts], RewardResult]


# ---- bounded staleness ----------------------------------------------------------------------------
def max_staleness(config: Config) -> float:
    """rollout.max_staleness resolved: 0 for async_mode=off, 1 by default otherwise."""
    bound = config.rollout.max_staleness
    return (0 if config.trainer.async_mode == "off" else 1) if bound is None else float(bound)


def pauses_for_training(config: Config) -> bool:
    """rollout.pause_for_training resolved: by default an engine beside the trainer on its device
    pauses in a synchronous or streaming run (one_step overlaps them; rollout workers have devices of
    their own)."""
    pause = config.rollout.pause_for_training
    if pause is None:
        return config.trainer.async_mode in ("off", "streaming") and not config.resources.rollout_workers
    return pause


def first_round_prompts(config: Config) -> int:
    """The prompts a step draws first: DAPO's prompts_per_round when it refills, else prompts_per_step."""
    dapo = config.algorithm.filter_groups
    return (
        (dapo.prompts_per_round or config.data.prompts_per_step)
        if dapo.enable
        else config.data.prompts_per_step
    )


def admissible(config: Config, *, version: int, stop_at: int) -> tuple[int, int]:
    """Under policy `version`, the last step whose groups may all have started, and how many of the
    next step's groups may start early. Step s is trained by policy s - 1, so steps up to
    version + 1 + max_staleness may start; a fractional bound lets that share of the following step's
    groups start too (the rest wait for the next update). Never past the run's last step."""
    bound = max_staleness(config)
    whole = int(bound)
    last = min(stop_at, version + 1 + whole)
    early = int((bound - whole) * first_round_prompts(config) + 1e-9)
    return last, early if last < stop_at else 0


def engine_batch_note(config: Config, *, on_gpu: bool) -> str | None:
    """A note for a streaming run whose engine, pausing for the trainer on a GPU, runs fewer sequences
    together than admission lets in: the next steps' groups then wait instead of filling the batch
    beside a step's long tail, where the pausing engine's gain comes from (docs/benchmarks.md)."""
    c = config
    if c.trainer.async_mode != "streaming" or not on_gpu or not pauses_for_training(c):
        return None
    admitted = math.ceil(c.data.prompts_per_step * c.rollout.samples_per_prompt * (1 + max_staleness(c)))
    if c.rollout.max_batch_sequences >= admitted:
        return None
    return (
        f"note: rollout.max_staleness={max_staleness(c):g} admits up to {admitted} sequences at once and the "
        f"engine runs rollout.max_batch_sequences={c.rollout.max_batch_sequences} of them together; "
        f"rollout.max_batch_sequences={admitted} lets the next steps' groups fill its batch beside a step's "
        "long tail (what pausing for the trainer gains)"
    )


def step_sampling(config: Config, round_: int, step: int, **overrides) -> SamplingParams:
    """The sampling parameters of `step`'s generation round `round_` (1: its groups, 2..: DAPO's
    refills, 0: ReMax's greedy pass, -1: validation): each step and round its own seed."""
    r = config.rollout
    seed = (config.trainer.seed * 1_000_003 + step * 1_009 + round_) % (2**31)
    fields = dict(
        n=r.samples_per_prompt,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_tokens=config.data.max_response_tokens,
        seed=seed,
    )
    return SamplingParams(**(fields | overrides))


# ---- DAPO: refill a step whose groups are filtered out --------------------------------------------
def fill_with_informative_groups(
    config: Config,
    first: tuple[Rollouts, RewardResult],
    next_round: Callable[[int], tuple[Rollouts, RewardResult]],
) -> tuple[Rollouts, RewardResult, dict[str, float]]:
    """DAPO's dynamic sampling: keep the groups whose scores differ (algorithm.filter_groups.metric)
    and take more rounds, `next_round(round_)` for round 2, 3, .. (its groups numbered from 0), until
    the step has prompts_per_step such groups or max_generation_rounds is reached. The step's batch,
    its reward (the last round's metrics, the rounds' scoring time summed) and dapo/* metrics."""
    dapo, wanted_groups = config.algorithm.filter_groups, config.data.prompts_per_step
    rounds = [first]
    kept: list[tuple[Rollouts, RewardResult]] = []
    groups = 0  # groups generated so far: the next round's ids start there
    while True:
        rollouts, result = rounds[-1]
        if len(rounds) > 1:
            rollouts.group_ids = [g + groups for g in rollouts.group_ids]
        keep = filter_zero_variance_groups(filter_values(config, result), rollouts.group_ids)
        keep = keep.nonzero()[:, 0].tolist()
        kept.append((rollouts.select(keep), result.select(keep)))
        groups += len(set(rollouts.group_ids))
        informative = len({g for r, _ in kept for g in r.group_ids})
        if informative >= wanted_groups or len(rounds) >= dapo.max_generation_rounds:
            break
        rounds.append(next_round(len(rounds) + 1))
    metrics = {k: v for k, v in result.metrics.items() if not k.startswith("timing_s/")}
    metrics["timing_s/reward"] = sum(r.metrics["timing_s/reward"] for _, r in rounds)
    rollouts = Rollouts.concat([r for r, _ in kept])
    result = RewardResult.concat([r for _, r in kept])
    wanted = set(sorted(set(rollouts.group_ids))[:wanted_groups])
    rows = [i for i, g in enumerate(rollouts.group_ids) if g in wanted]
    if not rows:  # every group agreed (e.g. a solved task): train on the last round, whose advantages are 0
        log.warning(
            "DAPO: no group with differing scores in %d rounds; this step carries no signal", len(rounds)
        )
        rollouts, result = rounds[-1]
        rows = list(range(len(rollouts)))
    metrics |= {"dapo/generation_rounds": float(len(rounds)), "dapo/kept_groups": float(len(wanted))}
    return rollouts.select(rows), result.select(rows), metrics


def filter_values(config: Config, result: RewardResult) -> torch.Tensor:
    """[B] what must differ within a group for DAPO to keep it (algorithm.filter_groups.metric)."""
    metric = config.algorithm.filter_groups.metric  # seq_final_reward = seq_reward (start checks)
    return {"acc": result.accs, "score": result.raw_scores}.get(metric, result.scores)


# ---- ReMax: a greedy baseline group ---------------------------------------------------------------
def greedy_baselines(
    rollouts: Rollouts, generate: Generate, score: Score, params: SamplingParams
) -> torch.Tensor:
    """[B] ReMax's baseline: the reward of one greedy response per prompt (`params`: n=1, temperature
    0), broadcast to its samples. Generated when the step's samples are taken, by the policy the
    engine holds then (a baseline needs only to be independent of the sample it is subtracted from)."""
    firsts = {g: i for i, g in reversed(list(enumerate(rollouts.group_ids)))}
    greedy = generate([rollouts.prompts[i] for i in firsts.values()], params)
    by_group = dict(zip(firsts, score(greedy).scores.tolist()))
    return torch.tensor([by_group[g] for g in rollouts.group_ids])
