"""TRL-style reward functions, called as TRL's GRPOTrainer calls them, behind verl's batched signature.

TRL calls each function with keywords only: `prompts`, `completions`, `completion_ids`, every other
dataset column by name (as lists), `trainer_state`, `log_extra` and `log_metric`. For a
conversational dataset (prompts are chat messages) each completion is a list of messages,
`[{"role": "assistant", "content": text}]`; otherwise a string. A function returns one float (or
None: no opinion) per completion; several functions are summed with `reward_weights`, skipping
Nones, and a completion every function left at None scores NaN (counted as an error).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridflow.errors import UserError
from hybridflow.rewards.loading import RESPONSE_IDS_KEY

ROW_KEY = "row"  # extra_info[ROW_KEY]: the dataset row (every column), kept for TRL-style functions


@dataclass
class TrainerState:
    """The part of transformers' TrainerState that reward functions read for shaping by progress."""

    global_step: int = 0
    max_steps: int = 0


def function_name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


class TRLRewards:
    """`TRLRewards(funcs, weights, prompt_key)` is a verl batched `compute_score(data_sources,
    solution_strs, ground_truths, extra_infos)`: each response's score is the weighted sum of the
    functions' rewards, and each function's own reward is reported as reward/<name>/mean."""

    wants_response_ids = True  # the Reward role adds each response's token ids to its extra_info

    def __init__(self, funcs: Sequence[Callable], weights: Sequence[float] | None, prompt_key: str) -> None:
        if not funcs:
            raise UserError("reward_funcs is empty: give at least one reward function")
        if weights is not None and len(weights) != len(funcs):
            raise UserError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
        self.funcs = list(funcs)
        self.weights = [float(w) for w in weights] if weights is not None else [1.0] * len(funcs)
        self.names = [function_name(f) for f in funcs]
        self.prompt_key = prompt_key
        self.state = TrainerState()

    def set_step(self, step: int, max_steps: int) -> None:
        self.state.global_step, self.state.max_steps = step, max_steps

    def __call__(self, data_sources, solution_strs, ground_truths, extra_infos) -> list[dict[str, Any]]:
        rows = [info[ROW_KEY] for info in extra_infos]
        prompts = [row[self.prompt_key] for row in rows]
        conversational = isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": s}] if conversational else s for s in solution_strs]
        metrics: dict[str, list[float]] = defaultdict(list)
        columns = {
            k: [row.get(k) for row in rows]
            for k in rows[0]
            if k not in ("prompt", "completion", "completion_ids")
        }
        kwargs = {
            **columns,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": [list(info.get(RESPONSE_IDS_KEY, [])) for info in extra_infos],
            "trainer_state": self.state,
            "log_extra": lambda column, values: None,  # TRL's completions table; samples.jsonl has ours
            "log_metric": lambda name, value: metrics[name].append(float(value)),
        }
        per_func = [
            self._call(fn, name, kwargs, len(solution_strs)) for fn, name in zip(self.funcs, self.names)
        ]
        out = []
        for i in range(len(solution_strs)):
            values = [
                (w, r[i]) for w, r in zip(self.weights, per_func) if r[i] is not None and not math.isnan(r[i])
            ]
            score = sum(w * r for w, r in values) if values else float("nan")
            item = {"score": score} | {
                name: r[i] for name, r in zip(self.names, per_func) if r[i] is not None
            }
            item |= {name: sum(v) / len(v) for name, v in metrics.items()}
            out.append(item)
        return out

    @staticmethod
    def _call(fn: Callable, name: str, kwargs: dict, count: int) -> list[float | None]:
        out = fn(**kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(out)
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) and not hasattr(out, "tolist"):
            raise TypeError(f"reward function {name} returned {type(out).__name__}, not a list of floats")
        out = out.tolist() if hasattr(out, "tolist") else list(out)
        if len(out) != count:
            raise ValueError(f"reward function {name} returned {len(out)} rewards for {count} completions")
        return [None if r is None else float(r) for r in out]


TRL_EXTRAS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def is_trl_keyword_style(fn: Callable) -> bool:
    """TRL's shape: called with keywords (it names `completions`, `completion_ids` or
    `trainer_state`, or takes only **kwargs)."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params}
    only_kwargs = all(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return bool(names & {"completions", "completion_ids", "trainer_state"}) or (bool(names) and only_kwargs)


def keyword_callable(fn: Callable) -> Callable:
    """A reward function as TRL calls it. `fn(prompts, responses, **columns)` (positional, the
    tutorials' shape) gets the prompts, the completions' text and the dataset's columns."""
    if is_trl_keyword_style(fn):
        return fn
    first = next(iter(inspect.signature(fn).parameters), None)
    if first in ("data_source", "data_sources", "data_source_list"):
        raise UserError(
            f"reward function {function_name(fn)} has verl's signature: pass it alone as reward_fn, not in a list"
        )
    positional = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    if len(positional) < 2:
        raise UserError(
            f"reward function {function_name(fn)}{inspect.signature(fn)}: expected TRL's "
            "f(completions, **kwargs), f(prompts, responses, **columns) or verl's "
            "compute_score(data_source, solution_str, ground_truth, extra_info)"
        )
    takes_columns = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()
    )

    def call(prompts, completions, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        columns = {k: v for k, v in kwargs.items() if k not in TRL_EXTRAS} if takes_columns else {}
        return fn(prompts, texts, **columns)

    call.__name__ = function_name(fn)
    return call
