"""The Reward role: score rollouts with the scorer of each row's data_source or a custom function."""

from __future__ import annotations

import importlib.util
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridflow.algorithms.losses import overlong_penalty
from hybridflow.batch import Rollouts
from hybridflow.config.schema import RewardConfig
from hybridflow.errors import UserError
from hybridflow.rewards.scorers import SCORERS, compute_score

log = logging.getLogger(__name__)


def load_custom_function(path: str, name: str) -> Callable:
    """Import `name` from the Python file at `path` (only the path the user configured)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"reward.custom_function_path: file not found: {file}")
    spec = importlib.util.spec_from_file_location(f"hybridflow_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise UserError(
            f"reward.custom_function_path: importing {file} failed: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"reward.custom_function_name: {file} defines no function {name!r}")
    return fn


@dataclass
class RewardResult:
    scores: torch.Tensor  # [B] final scalar reward per sequence (after shaping)
    raw_scores: torch.Tensor  # [B] scorer output before shaping (what accuracy is measured on)
    preds: list[str | None]
    metrics: dict[str, float] = field(default_factory=dict)

    def select(self, rows: list[int]) -> RewardResult:
        index = torch.tensor(rows, dtype=torch.long)
        return RewardResult(
            self.scores[index], self.raw_scores[index], [self.preds[i] for i in rows], self.metrics
        )

    @staticmethod
    def concat(parts: list[RewardResult]) -> RewardResult:
        return RewardResult(
            torch.cat([p.scores for p in parts]),
            torch.cat([p.raw_scores for p in parts]),
            [x for p in parts for x in p.preds],
            parts[-1].metrics if parts else {},
        )


class Reward:
    """Scores responses; an exception, a non-number or a NaN scores 0 and is counted (reward/errors)."""

    def __init__(self, tokenizer, config: RewardConfig, *, max_response_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.config = config
        self.max_response_tokens = max_response_tokens
        self.custom = (
            load_custom_function(config.custom_function_path, config.custom_function_name)
            if config.custom_function_path
            else None
        )

    def check_sources(self, data_sources: set[str]) -> None:
        """Fail at start, not mid-run, when a data_source has no scorer."""
        if self.custom is None:
            unknown = sorted(data_sources - set(SCORERS))
            if unknown:
                raise UserError(
                    f"no reward scorer for data_source {unknown[0]!r}; built-in sources: {', '.join(SCORERS)} "
                    "(set reward.custom_function_path for your own)"
                )

    def _score_one(
        self, data_source: str, text: str, ground_truth, extra_info: dict
    ) -> tuple[float, str | None, dict, bool]:
        fn = self.custom or compute_score
        try:
            out = fn(data_source, text, ground_truth, extra_info)
        except Exception as e:  # a reward bug must never crash the step
            log.debug("reward function raised %s: %s", type(e).__name__, e)
            return 0.0, None, {}, True
        extras = {}
        if isinstance(out, dict):
            extras = {
                k: v for k, v in out.items() if k not in ("score", "pred") and isinstance(v, (int, float))
            }
            pred, out = out.get("pred"), out.get("score")
        else:
            pred = None
        try:
            value = float(out)
        except (TypeError, ValueError):
            return 0.0, pred, extras, True
        if not math.isfinite(value):
            return 0.0, pred, extras, True
        return value, pred, extras, False

    def score(self, rollouts: Rollouts) -> RewardResult:
        start = time.perf_counter()
        raw, preds, errors = [], [], 0
        extras: dict[str, list[float]] = defaultdict(list)
        for prompt, response in zip(rollouts.prompts, rollouts.response_ids):
            text = self.tokenizer.decode(response, skip_special_tokens=True)
            value, pred, extra, failed = self._score_one(
                prompt.data_source, text, prompt.ground_truth, prompt.extra_info
            )
            raw.append(value)
            preds.append(pred)
            errors += failed
            for k, v in extra.items():
                extras[k].append(float(v))
        raw_scores = torch.tensor(raw, dtype=torch.float32)
        scores = raw_scores.clone()
        buffer = self.config.overlong_buffer
        if buffer.enable:
            lengths = torch.tensor([len(r) for r in rollouts.response_ids])
            penalty = overlong_penalty(
                lengths, self.max_response_tokens, buffer.buffer_tokens, buffer.penalty_factor
            )
            scores = scores + penalty
        metrics = {"reward/errors": float(errors), "timing_s/reward": time.perf_counter() - start}
        if buffer.enable:
            metrics["reward/overlong_penalty/mean"] = float((scores - raw_scores).mean()) if len(raw) else 0.0
        for k, values in extras.items():
            metrics[f"reward/{k}/mean"] = sum(values) / len(values)
        return RewardResult(scores, raw_scores, preds, metrics)
