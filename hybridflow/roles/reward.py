"""The Reward role: score rollouts with the scorer of each row's data_source (or a custom function)
in a process pool with timeouts, optionally plus a reward model, then apply DAPO overlong shaping."""

from __future__ import annotations

import functools
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from hybridflow.algorithms.losses import overlong_penalty
from hybridflow.batch import Rollouts
from hybridflow.config.schema import RewardConfig
from hybridflow.errors import UserError
from hybridflow.rewards.executor import Outcome, RewardExecutor
from hybridflow.rewards.loading import RESPONSE_IDS_KEY, builtin_function, check_import, load_custom_function
from hybridflow.rewards.sandbox import SandboxLimits
from hybridflow.rewards.scorers import SCORERS

log = logging.getLogger(__name__)


class RewardFunctionFailed(UserError):
    """Every response of a batch errored in the reward function: training on zeros would be silent."""


@dataclass
class RewardResult:
    scores: torch.Tensor  # [B] final scalar reward per sequence (after weighting and shaping)
    raw_scores: torch.Tensor  # [B] rule score before shaping (what accuracy is measured on)
    preds: list[str | None]
    metrics: dict[str, float] = field(default_factory=dict)
    accs: torch.Tensor | None = None
    """[B] the function's `acc` where it returned one, else its score (raw_scores): what validation
    reports as accuracy and DAPO's filter_groups.metric=acc compares."""
    acc_given: bool = False
    """The function returned an `acc`: validation names its metric val-core/<source>/acc (verl's
    rule), else val-core/<source>/reward."""
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """[B] each further number every response's result carried (e.g. a lenient second check):
    validation reports them as val-aux/<source>/<key>/mean@N (verl's naming)."""

    def __post_init__(self) -> None:
        if self.accs is None:
            self.accs = self.raw_scores

    def select(self, rows: list[int]) -> RewardResult:
        index = torch.tensor(rows, dtype=torch.long)
        return RewardResult(
            self.scores[index],
            self.raw_scores[index],
            [self.preds[i] for i in rows],
            self.metrics,
            self.accs[index],
            self.acc_given,
            {k: v[index] for k, v in self.extras.items()},
        )

    @staticmethod
    def concat(parts: list[RewardResult]) -> RewardResult:
        shared = set.intersection(*(set(p.extras) for p in parts)) if parts else set()
        return RewardResult(
            torch.cat([p.scores for p in parts]),
            torch.cat([p.raw_scores for p in parts]),
            [x for p in parts for x in p.preds],
            parts[-1].metrics if parts else {},
            torch.cat([p.accs for p in parts]),
            any(p.acc_given for p in parts),
            {k: torch.cat([p.extras[k] for p in parts]) for k in sorted(shared)},
        )


class Reward:
    """Scores responses. An exception, a timeout, a non-number or a NaN scores 0 and is counted
    (reward/errors, reward/timeouts); scoring never crashes or stalls the step."""

    def __init__(
        self,
        tokenizer,
        config: RewardConfig,
        *,
        max_response_tokens: int,
        hide: tuple[str, ...] = (),
        device="cpu",
        function: Callable | None = None,
    ) -> None:
        """`function`: a live reward function (verl's signature, per-sample or batched) scored in
        this process: a lambda or a notebook's closure cannot reach spawned workers."""
        self.tokenizer = tokenizer
        self.config = config
        self._error_shown = False
        self.function = function
        self.max_response_tokens = max_response_tokens
        self.custom = function is not None or config.custom_function_path is not None
        num_workers = config.num_workers
        if function is not None:
            loader, options, num_workers = (lambda: function), {}, 0
        elif self.custom:
            check_import(
                config.custom_function_path, timeout_s=config.import_timeout_s
            )  # hang, exit: one line
            loader = functools.partial(
                load_custom_function, config.custom_function_path, config.custom_function_name,
                kwargs=dict(config.custom_function_kwargs),
            )  # fmt: skip
            options: dict = {}
        else:
            loader = builtin_function
            limits = SandboxLimits(
                wall_s=config.sandbox_timeout_s,
                cpu_s=max(1, int(config.sandbox_timeout_s)),
                memory_mb=config.sandbox_memory_mb,
            )
            options = {
                "guards": config.guards,
                "max_response_chars": config.max_response_chars,
                "format_pattern": config.format_pattern,
                "format_weight": config.format_weight,
                "code_options": {
                    "all_or_nothing": config.code_all_or_nothing,
                    "limits": limits,
                    "hide": tuple(hide),
                },
            }
        self.executor = RewardExecutor(
            loader,
            num_workers=num_workers,
            timeout_s=config.timeout_s,
            options=options,
            max_abs=config.max_abs,
        )
        self.model = None
        if config.model_path:
            from hybridflow.rewards.reward_model import RewardModel

            self.model = RewardModel(
                config.model_path,
                device=device,
                max_tokens_per_microbatch=config.model_max_tokens_per_microbatch,
            )

    @property
    def uses_rules(self) -> bool:
        """A reward model with rule_weight 0 is used alone: no rule scoring at all."""
        return self.model is None or self.config.rule_weight != 0

    def check_sources(self, data_sources: set[str]) -> None:
        """Fail at start, not mid-run, when a data_source has no scorer."""
        if not self.custom and self.uses_rules:
            unknown = sorted(data_sources - set(SCORERS))
            if unknown:
                raise UserError(
                    f"no reward scorer for data_source {unknown[0]!r}; built-in sources: {', '.join(SCORERS)} "
                    "(set reward.custom_function_path for your own)"
                )

    def submit(self, rollouts: Rollouts) -> tuple[Future, float]:
        """Start scoring (rule scores run in the pool while the caller goes on)."""
        sampled = rollouts.sampled_ids()  # the policy's own tokens: a tool's output is not scored
        texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in sampled]
        infos = [p.extra_info for p in rollouts.prompts]
        if getattr(self.function, "wants_response_ids", False):  # TRL's completion_ids
            infos = [{**info, RESPONSE_IDS_KEY: ids} for info, ids in zip(infos, sampled)]
        items = [(p.data_source, t, p.ground_truth, i) for p, t, i in zip(rollouts.prompts, texts, infos)]
        if rollouts.scores is not None:  # rows whose agent loop gave the outcome are not scored again
            items = [item for item, given in zip(items, rollouts.scores) if given is None]
        if not self.uses_rules:
            items = []
        return self.executor.submit(items), time.perf_counter()

    def result(self, rollouts: Rollouts, pending: tuple[Future, float]) -> RewardResult:
        return self.summarize(rollouts, self.outcomes(rollouts, pending), pending[1])

    def outcomes(self, rollouts: Rollouts, pending: tuple[Future, float]) -> list[Outcome]:
        """Each row's outcome once its scoring is done (a streaming run collects them group by group)."""
        future, _ = pending
        given = rollouts.scores or [None] * len(rollouts)
        scored = self.executor.result(future, sum(g is None for g in given)) or [
            Outcome() for g in given if g is None
        ]
        fresh = iter(scored)
        return [next(fresh) if g is None else Outcome(score=float(g)) for g in given]

    def summarize(self, rollouts: Rollouts, outcomes: list[Outcome], start: float) -> RewardResult:
        """The batch's scores and reward/* metrics from its rows' outcomes (the reward model, when
        there is one, scores here); `start`: when scoring began, for timing_s/reward."""
        given = rollouts.scores or [None] * len(rollouts)
        self._report_errors([o for o, g in zip(outcomes, given) if g is None])  # the batch's, not a group's
        raw = torch.tensor([o.score for o in outcomes], dtype=torch.float32)
        scores = raw * (self.config.rule_weight if self.model is not None else 1.0)
        metrics = {
            "reward/errors": float(sum(o.error for o in outcomes)),
            "reward/timeouts": float(sum(o.timeout for o in outcomes)),
        }
        latencies = torch.tensor([o.latency_ms for o in outcomes]) if outcomes else torch.zeros(1)
        metrics["reward/latency_p95_ms"] = torch.quantile(latencies, 0.95).item()
        if self.model is not None:
            texts = [self.tokenizer.decode(r, skip_special_tokens=True) for r in rollouts.sampled_ids()]
            prompts = [p.messages if p.messages is not None else p.text for p in rollouts.prompts]
            model_scores = self.model.score(prompts, texts)
            scores = scores + self.config.model_weight * model_scores
            metrics["reward/model_score/mean"] = model_scores.mean().item()
            if not self.uses_rules:
                raw = model_scores
        buffer = self.config.overlong_buffer
        if buffer.enable:
            lengths = torch.tensor([len(r) for r in rollouts.response_ids])
            penalty = overlong_penalty(
                lengths, self.max_response_tokens, buffer.buffer_tokens, buffer.penalty_factor
            )
            scores = scores + penalty
            metrics["reward/overlong_penalty/mean"] = penalty.float().mean().item()
        extras: dict[str, list[float]] = defaultdict(list)
        for o in outcomes:
            for k, v in o.extras.items():
                extras[k].append(v)
        metrics |= {f"reward/{k}/mean": sum(v) / len(v) for k, v in extras.items()}
        metrics["timing_s/reward"] = time.perf_counter() - start
        acc_given = self.uses_rules and any("acc" in o.extras for o in outcomes)
        accs = (
            torch.tensor([o.extras.get("acc", o.score) for o in outcomes], dtype=torch.float32)
            if acc_given
            else raw
        )
        every = set.intersection(*(set(o.extras) for o in outcomes)) - {"acc"} if outcomes else set()
        per_row = {k: torch.tensor([float(o.extras[k]) for o in outcomes]) for k in sorted(every)}
        return RewardResult(scores, raw, [o.pred for o in outcomes], metrics, accs, acc_given, per_row)

    def score(self, rollouts: Rollouts) -> RewardResult:
        return self.result(rollouts, self.submit(rollouts))

    def set_step(self, step: int, max_steps: int) -> None:
        """Tell a live function that follows training progress (TRL's trainer_state) the step."""
        if hasattr(self.function, "set_step"):
            self.function.set_step(step, max_steps)

    def _report_errors(self, outcomes: list[Outcome]) -> None:
        """The first error of the run is printed with its traceback; a batch in which every response
        errored stops the run (reward.on_all_errors=stop) instead of training on zeros."""
        failed = [o for o in outcomes if o.error]
        if not failed:
            return
        first = next((o.message for o in failed if o.message), "no details")
        everything = len(failed) == len(outcomes)
        if everything and self.config.on_all_errors == "stop":
            raise RewardFunctionFailed(
                f"the reward function failed on all {len(outcomes)} responses of this batch; the first error:\n"
                f"{first.rstrip()}\n(reward.on_all_errors=warn goes on, scoring them 0)"
            )
        if not self._error_shown or everything:
            self._error_shown = True
            log.warning(
                "the reward function failed on %d of %d responses (scored 0, counted in reward/errors); "
                "the first error:\n%s",
                len(failed),
                len(outcomes),
                first.rstrip(),
            )

    def run_at_niceness(self, niceness: int) -> None:
        self.executor.run_at_niceness(niceness)

    def close(self) -> None:
        self.executor.close()
