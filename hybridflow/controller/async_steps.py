"""The asynchronous step's own pieces (trainer.async_mode one_step / streaming): admission of groups
under the staleness bound, a step's batch from the stream, and the async/* metrics. `trainer` is the
RLTrainer; its GroupStream is `trainer.stream`."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hybridflow.batch import GapScope, Rollouts, pad_ragged
from hybridflow.controller.async_checks import max_staleness, pauses_for_training
from hybridflow.controller.group_stream import GroupStream
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.controller.remote_stream import RemoteGroupStream
from hybridflow.roles.reward import RewardResult


def open_stream(trainer) -> GroupStream | RemoteGroupStream:
    """The stream over the (in-process) worker's engine, or over the rollout workers' engines,
    holding the policy of the trainer's step."""
    c = trainer.config
    if trainer.placement.rollout is not None:
        return RemoteGroupStream(
            trainer.placement,
            trainer.reward,
            agent=bool(c.rollout.agent.loop),
            version=trainer.step,
            in_flight_updates=c.trainer.async_mode == "streaming",
            deadline_s=c.trainer.watchdog_s or 3600.0,
            max_replacements=c.resources.max_rollout_worker_replacements,
        )
    ((engine, agent),) = trainer.workers.call(HybridWorker.rollout_parts)
    return GroupStream(
        engine,
        trainer.reward,
        agent=agent,
        version=trainer.step,
        in_flight_updates=c.trainer.async_mode == "streaming",
        deadline_s=c.trainer.watchdog_s or 3600.0,
        resume=trainer.in_flight,
        pause_for_training=pauses_for_training(c),
        # as a synchronous step frees the pool for the other roles (HybridWorker.sleep_rollout), unless
        # the K/V of the sequences in flight are to outlive the update
        free_cache_while_paused=c.rollout.free_cache_engine
        and not c.rollout.keep_kv_on_weight_update
        and engine.device.type == "cuda",
    )


def admit(trainer) -> None:
    """Admit the groups of every step whose batch will be at most max_staleness updates behind the
    policy that trains on it: step s is trained by policy s - 1, so with the engine at version v the
    steps up to v + 1 + max_staleness may start. A fractional bound lets that share of the following
    step's groups start too (the rest wait for the next update). Never past the run's last step."""
    c, stream = trainer.config, trainer.stream
    bound = max_staleness(c)
    whole = int(bound)
    last = min(trainer.stop_at, stream.version + 1 + whole)
    while trainer.admitted < last:
        admit_groups(trainer, trainer.admitted + 1, c.data.prompts_per_step)
    early = int((bound - whole) * c.data.prompts_per_step + 1e-9)
    if early and last < trainer.stop_at:
        admit_groups(trainer, last + 1, early)


@dataclass
class DrawnStep:
    """A step whose prompts are drawn, not all of whose groups have started yet."""

    prompts: list
    started: int = 0


def admit_groups(trainer, step: int, count: int) -> None:
    """The first `count` groups of `step` started (its prompts drawn when it is first admitted, the
    sampler's state kept for a resume); the step counts as admitted once all of them are."""
    if step not in trainer.drawn:
        trainer.sampler_before[step] = trainer.sampler.state_dict()  # a checkpoint of step - 1 resumes here
        trainer.drawn[step] = DrawnStep(trainer.sampler.next())
        trainer.epoch_of[step] = trainer.sampler.epoch
    drawn = trainer.drawn[step]
    count = min(count, len(drawn.prompts))
    if count > drawn.started:
        trainer.stream.submit(
            drawn.prompts[drawn.started : count],
            trainer.sampling(1, step=step),
            first_group=group_base(trainer.config, step),
            offset=drawn.started,
        )
        drawn.started = count
    if count == len(drawn.prompts):
        del trainer.drawn[step]
        trainer.admitted = step


def group_base(c, step: int) -> int:
    return (step - 1) * c.data.prompts_per_step


def take_step(trainer) -> tuple[Rollouts, RewardResult, dict[str, float]]:
    """The step's groups once finished and scored, as a synchronous step's batch (group ids are the
    prompts' positions in the step), and the async/* metrics of how they were made."""
    c, stream, step = trainer.config, trainer.stream, trainer.step
    base = group_base(c, step)
    group_ids = list(range(base, base + c.data.prompts_per_step))
    stream.run_until(group_ids)  # an engine that pauses for training generates now, until these are done
    groups, waited = stream.take(group_ids)
    rollouts = Rollouts.concat([g.rollouts for g in groups])
    rollouts.group_ids = [g - base for g in rollouts.group_ids]
    start = time.perf_counter()
    scored = trainer.reward.summarize(rollouts, [o for g in groups for o in g.outcomes], start)
    metrics = {k: v for k, v in scored.metrics.items() if not k.startswith("timing_s/")}
    metrics["timing_s/reward"] = scored.metrics["timing_s/reward"]  # what was left after the stream scored
    metrics |= staleness_metrics(rollouts, trained_by=step - 1)
    metrics["async/wait_for_groups_s"] = waited  # the trainer's idle time
    metrics["async/generation_idle_s"] = stream.take_idle_seconds()  # the engine's, since the last step
    metrics["async/groups_running"] = float(stream.running)
    metrics["async/recomputed_tokens"] = float(stream.take_recomputed_tokens())  # K/V prefilled again
    metrics |= stream.take_recovery_metrics()  # rollout workers replaced, groups submitted again
    return rollouts, scored, metrics


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
