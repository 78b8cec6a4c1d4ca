"""Where a step's training batch comes from: one surface (`TrainingBatches`) in every mode, so the
driver never asks which. `take(step)` gives the step's rollouts, scored; `update_weights(version)` puts
the trained policy into the engines between two of their steps; `validate` generates beside it;
`resume_point(step)` is what a checkpoint keeps of it; `close` ends it.

Two sources stand behind it. `StreamedBatches` is the stream of groups (stream/remote.py, over the
engines of the workers that generate, each running stream/local.py's GroupStream) with admission under
rollout.max_staleness: 0 is the synchronous run (trainer.async_mode=off), 1 one-step-off, more
streaming. `WholeBatches` is the adapter for generation that only takes a whole batch (transformers,
vLLM, an engine split over workers, the policy served over HTTP): it admits at staleness 0, a step's
prompts generated when the step asks. Both
apply the same admission policies (stream/admission.py) when a step is taken: DAPO's refill of
filtered-out groups and ReMax's greedy baseline group."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridflow.algorithms.estimators import estimator
from hybridflow.batch import Prompt, Rollouts
from hybridflow.config import Config
from hybridflow.controller.validation import validate
from hybridflow.data.sampler import PromptSampler
from hybridflow.errors import UserError
from hybridflow.roles.reward import Reward, RewardResult
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.stream.admission import (
    admissible,
    fill_with_informative_groups,
    first_round_prompts,
    greedy_baselines,
    max_staleness,
    pauses_for_training,
    step_sampling,
)
from hybridflow.stream.staleness import staleness_metrics
from hybridflow.tracking.progress import bar

Phase = Callable[[str], AbstractContextManager]
"""The watchdog's phase: `with phase("reward"):` names what a hang was doing."""


@dataclass
class Taken:
    """A step's batch as its source gives it."""

    rollouts: Rollouts  # group ids are the prompts' positions in the step
    scored: RewardResult
    baselines: torch.Tensor | None  # [B] ReMax's greedy reward per row; None for other estimators
    metrics: dict[str, float]  # reward/*, dapo/*, async/* and timing_s/reward
    epoch: int  # the epoch its prompts came from


@dataclass
class ResumePoint:
    """What a checkpoint after a step keeps of the source."""

    sampler: dict  # where the next step's prompts are drawn from
    in_flight: dict | None  # the groups admitted and not taken (StreamedBatches), as JSON


class TrainingBatches(Protocol):
    def start(self, stop_at: int) -> None:
        """Before the first step of a fit (which ends at step `stop_at`): admit what may start."""

    def take(self, step: int) -> Taken: ...

    def update_weights(self, version: int) -> dict[str, float]:
        """The actor's weights into every engine, which then holds policy `version`; async/* metrics."""

    def validate(self, prompts: list[Prompt], params: SamplingParams) -> tuple[dict[str, float], list[dict]]:
        """controller/validation.py's metrics and samples, generated beside the training batches."""

    def resume_point(self, step: int) -> ResumePoint: ...

    def close(self) -> None: ...


def open_batches(config: Config, placement, roles, reward: Reward, sampler: PromptSampler, phase: Phase,
                 *, version: int, in_flight: dict | None, stop_at: int) -> TrainingBatches:  # fmt: skip
    """The stream of groups wherever the engines take requests one by one (the synchronous run is
    its staleness 0), else the whole-batch adapter (transformers' or vLLM's generation, an engine
    split over workers, the policy served over HTTP); `version`: the policy the engines hold (the step
    the run resumes from); `stop_at`: the run's last step (`start` moves it)."""
    c = config
    if whole_batches_only(c, placement):
        if c.trainer.async_mode != "off":
            raise UserError(
                f"trainer.async_mode={c.trainer.async_mode} streams groups through the built-in engine, and this "
                "run's rollout backend generates whole batches only (a model family without a native "
                "implementation: rollout.backend=auto chose transformers): use trainer.async_mode=off"
            )
        return WholeBatches(c, placement, roles, reward, sampler, phase)
    return StreamedBatches(c, open_stream(c, placement, reward, version, in_flight, phase), placement, reward,
                           sampler, phase, stop_at=stop_at)  # fmt: skip


def whole_batches_only(config: Config, placement) -> bool:
    """Generation that takes a whole batch at a time: an engine split over workers or served over
    HTTP, or a backend (transformers, vLLM) that is not the native engine on some worker."""
    from hybridflow.stream.host import StreamHost, hosted

    if config.rollout.tensor_parallel_size > 1 or config.rollout.server:
        return True
    return not all(placement.generators.call(hosted(StreamHost.can_stream)))


def take_policies(config: Config, step: int, first: tuple[Rollouts, RewardResult], generate, score,
                  draw: Callable[[int], list[Prompt]]) -> tuple[Rollouts, RewardResult, torch.Tensor | None, dict]:  # fmt: skip
    """The admission policies applied to a step's first round when it is taken: DAPO's refill
    (`draw(n)` more prompts a round) and ReMax's greedy baselines; `generate(prompts, params)` and
    `score(rollouts)` are the source's."""
    rollouts, scored = first
    metrics = {k: v for k, v in scored.metrics.items() if not k.startswith("timing_s/")}
    metrics["timing_s/reward"] = scored.metrics["timing_s/reward"]
    if config.algorithm.filter_groups.enable:
        per_round = first_round_prompts(config)

        def next_round(round_: int) -> tuple[Rollouts, RewardResult]:
            rollouts = generate(draw(per_round), step_sampling(config, round_, step))
            return rollouts, score(rollouts)

        rollouts, scored, dapo = fill_with_informative_groups(config, first, next_round)
        metrics |= dapo
    baselines = None
    if estimator(config.algorithm.adv_estimator).needs_greedy_baseline:
        params = step_sampling(config, 0, step, n=1, temperature=0.0)
        baselines = greedy_baselines(rollouts, generate, score, params)
        metrics["remax/greedy_score_mean"] = baselines.mean().item()
    return rollouts, scored, baselines, metrics


class WholeBatches:
    """Staleness 0 over whole-batch generation: the step's prompts generated (split over the workers
    that generate) and scored when the step asks, then the colocated engines' KV cache freed for the
    other roles."""

    def __init__(self, config: Config, placement, roles, reward: Reward, sampler: PromptSampler,
                 phase: Phase) -> None:  # fmt: skip
        self.config, self.placement, self.roles = config, placement, roles
        self.reward, self.sampler, self.phase = reward, sampler, phase

    def start(self, stop_at: int) -> None:
        pass

    def take(self, step: int) -> Taken:
        c = self.config
        rollouts = self.roles.rollouts(self.sampler.next(first_round_prompts(c)), step_sampling(c, 1, step))
        rollouts, scored, baselines, metrics = take_policies(
            c, step, (rollouts, self._score(rollouts)), self.roles.rollouts, self._score, self.sampler.next
        )
        self.placement.sleep_rollout()
        return Taken(rollouts, scored, baselines, metrics, self.sampler.epoch)

    def _score(self, rollouts: Rollouts) -> RewardResult:
        with self.phase("reward"):
            return self.reward.score(rollouts)

    def update_weights(self, version: int) -> dict[str, float]:
        self.placement.sync_weights()
        return {}

    def validate(self, prompts: list[Prompt], params: SamplingParams) -> tuple[dict[str, float], list[dict]]:
        try:
            return validate(self.roles.rollouts, self.reward, prompts, params)
        finally:
            self.placement.sleep_rollout()

    def resume_point(self, step: int) -> ResumePoint:
        return ResumePoint(self.sampler.state_dict(), None)

    def close(self) -> None:
        pass


def engine_metrics(counts: dict[str, int]) -> dict[str, float]:
    """Where generation's time went since the last batch, under verl's families for figures of the
    machine and the clock: the engines' prefill and decode runs, the decode steps those took and
    the runs launched before the last was read (perf/gen_*), and the seconds of each, graph
    captures' among them (timing_s/gen_*, parts of timing_s/gen where the batch is generated in the
    step)."""
    get = counts.get
    return {
        "perf/gen_prefill_runs": float(get("prefill_runs", 0)),
        "perf/gen_decode_runs": float(get("decode_runs", 0)),
        "perf/gen_decode_steps": float(get("decode_steps", 0)),
        "perf/gen_decode_runs_ahead": float(get("decode_runs_ahead", 0)),
        "timing_s/gen_prefill": get("prefill_ms", 0) / 1e3,
        "timing_s/gen_decode": get("decode_ms", 0) / 1e3,
        "timing_s/gen_graph_capture": get("graph_capture_ms", 0) / 1e3,
    }


def speculative_metrics(counts: dict[str, int]) -> dict[str, float]:
    """rollout/speculative_*: the engines' speculative steps since the last batch, the tokens they
    drafted and accepted, the share accepted, and the tokens a sequence got per speculative step
    (1 without speculation: the forwards saved)."""
    get = counts.get
    drafted, accepted, rows = (
        get("speculative_drafted", 0),
        get("speculative_accepted", 0),
        get("speculative_rows", 0),
    )
    return {
        "rollout/speculative_steps": float(get("speculative_steps", 0)),
        "rollout/speculative_drafted": float(drafted),
        "rollout/speculative_accepted": float(accepted),
        "rollout/speculative_acceptance": accepted / drafted if drafted else 0.0,
        "rollout/speculative_tokens_per_row": get("speculative_tokens", 0) / rows if rows else 0.0,
    }


@dataclass
class _DrawnStep:
    """A step whose prompts are drawn, not all of whose groups have started yet."""

    prompts: list[Prompt]
    started: int = 0


class StreamedBatches:
    """The stream of groups under bounded staleness: the groups of every step whose batch will be at
    most rollout.max_staleness updates behind the policy that trains on it are admitted (at the start
    and after each update), generated and scored meanwhile, and taken in admission order."""

    def __init__(self, config: Config, stream, placement, reward: Reward, sampler: PromptSampler,
                 phase: Phase, *, stop_at: int) -> None:  # fmt: skip
        self.config, self.stream, self.placement = config, stream, placement
        self.reward, self.sampler, self.phase = reward, sampler, phase
        self.admitted = stream.version  # the last step whose groups were all admitted
        self.stop_at = stop_at  # never admitted past (a caller that drives train_step itself keeps it)
        self._drawn: dict[int, _DrawnStep] = {}  # steps only some of whose groups have started
        self._sampler_before: dict[int, dict] = {}  # step -> the sampler's state before its prompts
        self._epoch_of: dict[int, int] = {}  # step -> the epoch its prompts came from

    def start(self, stop_at: int) -> None:
        self.stop_at = stop_at
        if self._ahead:
            self._admit()

    @property
    def _ahead(self) -> bool:
        """Groups start ahead of the step that takes them: at staleness 0 a step's groups are admitted
        when it is taken, so nothing is in flight at a checkpoint or beside a validation (the
        synchronous run); else at the start and after each update."""
        return max_staleness(self.config) > 0

    def _admit(self) -> None:
        """Every group the policy the engines hold lets in."""
        last, early = admissible(self.config, version=self.stream.version, stop_at=self.stop_at)
        while self.admitted < last:
            self._admit_groups(self.admitted + 1, first_round_prompts(self.config))
        if early:
            self._admit_groups(last + 1, early)

    def _admit_groups(self, step: int, count: int) -> None:
        """The first `count` groups of `step` started (its prompts drawn when it is first admitted, the
        sampler's state kept for a resume); the step counts as admitted once all of them are."""
        if step not in self._drawn:
            self._sampler_before[step] = self.sampler.state_dict()  # a checkpoint of step - 1 resumes here
            self._drawn[step] = _DrawnStep(self.sampler.next(first_round_prompts(self.config)))
            self._epoch_of[step] = self.sampler.epoch
        drawn = self._drawn[step]
        count = min(count, len(drawn.prompts))
        if count > drawn.started:
            self.stream.submit(
                drawn.prompts[drawn.started : count],
                step_sampling(self.config, 1, step),
                first_group=self._group_base(step),
                offset=drawn.started,
            )
            drawn.started = count
        if count == len(drawn.prompts):
            del self._drawn[step]
            self.admitted = step

    def _group_base(self, step: int) -> int:
        return (step - 1) * first_round_prompts(self.config)

    def take(self, step: int) -> Taken:
        """The step's groups once finished and scored, as a synchronous step's batch, and the async/*
        metrics of how they were made."""
        self._admit()  # (at staleness 0: this step's groups, now)
        base = self._group_base(step)
        group_ids = list(range(base, base + first_round_prompts(self.config)))
        # an engine that pauses for training generates now, until these are done
        self.stream.run_until(group_ids)
        finished = bar(
            len(group_ids), "generate", enabled=self.config.trainer.progress, inner=True, unit="groups"
        )
        try:
            groups, waited = self.stream.take(
                group_ids, progress=lambda done: finished.update(done - finished.n)
            )
        finally:
            finished.close()
        rollouts = Rollouts.concat([g.rollouts for g in groups])
        rollouts.group_ids = [g - base for g in rollouts.group_ids]
        scored = self.reward.summarize(rollouts, [o for g in groups for o in g.outcomes], time.perf_counter())
        rollouts, scored, baselines, metrics = take_policies(
            self.config, step, (rollouts, scored), self.stream.generate_now, self._score, self.sampler.next
        )
        counts = self.stream.take_engine_counts()
        metrics |= engine_metrics(counts)
        if self.config.trainer.async_mode != "off":  # how the batch was made beside training
            metrics |= self._async_metrics(rollouts, step, waited, counts)
        if self.config.rollout.speculative.num_speculative_tokens:
            metrics |= speculative_metrics(counts)
        recovery = self.stream.take_recovery_metrics()  # rollout workers replaced, groups submitted again
        if self.config.trainer.async_mode != "off" or any(recovery.values()):
            metrics |= recovery
        self._sampler_before.pop(step, None)
        return Taken(rollouts, scored, baselines, metrics, self._epoch_of.pop(step, self.sampler.epoch))

    def _async_metrics(self, rollouts: Rollouts, step: int, waited: float, counts: dict) -> dict[str, float]:
        return staleness_metrics(rollouts, trained_by=step - 1) | {
            "async/wait_for_groups_s": waited,  # the trainer's idle time
            "async/generation_idle_s": self.stream.take_idle_seconds(),  # the engine's, since the last step
            "async/groups_running": float(self.stream.running),
            "async/recomputed_tokens": float(counts.get("recomputed_tokens", 0)),  # K/V prefilled again
        }

    def _score(self, rollouts: Rollouts) -> RewardResult:
        """Beside the stream, the reward is called by one thread at a time (a function need not be thread-safe)."""
        with self.stream.scoring, self.phase("reward"):
            return self.reward.score(rollouts)

    def update_weights(self, version: int) -> dict[str, float]:
        """Between two engine steps; one_step waits for the groups in flight first. Then the groups
        the new policy lets in are admitted."""
        waited = self.stream.update_weights(lambda _engine: self.placement.sync_weights(), version=version)
        if self._ahead:
            self._admit()
        return {"async/wait_for_generation_s": waited} if self.config.trainer.async_mode != "off" else {}

    def validate(self, prompts: list[Prompt], params: SamplingParams) -> tuple[dict[str, float], list[dict]]:
        with self.stream.scoring:
            return validate(self.stream.generate_now, self.reward, prompts, params)

    def resume_point(self, step: int) -> ResumePoint:
        """Before the prompts of step + 1, which may be drawn (and generating) already."""
        return ResumePoint(
            self._sampler_before.get(step + 1, self.sampler.state_dict()), self.stream.snapshot()
        )

    def close(self) -> None:
        self.stream.close()


def open_stream(
    config: Config, placement, reward: Reward, version: int, in_flight: dict | None, phase: Phase
):
    """The stream over the engines of the workers that generate (the colocated training workers, or
    the rollout workers), holding policy `version`; `in_flight`: a checkpoint's groups to go on with."""
    from hybridflow.stream.remote import RemoteGroupStream

    c = config
    return RemoteGroupStream(
        placement,
        reward,
        agent=bool(c.rollout.agent.loop),
        version=version,
        in_flight_updates=c.trainer.async_mode == "streaming",
        # past the watchdog's limit, which names the stuck phase first: this is the backstop without it
        deadline_s=c.trainer.watchdog_s + 60.0 if c.trainer.watchdog_s else 3600.0,
        resume=in_flight,
        pause_for_training=pauses_for_training(c),
        # as a synchronous step frees the pool for the other roles (HybridWorker.sleep_rollout), unless
        # the K/V of the sequences in flight are to outlive the update (on a GPU: stream/host.py)
        free_cache_while_paused=c.rollout.free_cache_engine and not c.rollout.keep_kv_on_weight_update,
        max_replacements=c.resources.max_rollout_worker_replacements,
        phase=phase,
    )
