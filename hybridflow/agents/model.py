"""A token-in, token-out handle on the engine for agent loops: one model call per turn."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.rollout.sampling import SamplingParams


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Under the sampling distribution, one per token."""
    finish_reason: str
    """'stop' (EOS or a stop token, which ends token_ids) or 'length'."""
    weight_version: int
    """The newest weight version among the tokens (a call that spans an update has two)."""
    weight_versions: list[int] | None = None
    """Each token's weight version; None: all of them `weight_version`."""

    def __post_init__(self) -> None:
        if self.weight_versions is None:
            self.weight_versions = [self.weight_version] * len(self.token_ids)


class EngineModel:
    """`await model.generate(token_ids, max_tokens=...)`: one sample of the episode's policy.

    Each call of an episode draws from its own reproducible stream: (seed, first_sequence + call),
    so an episode samples the same tokens whatever else shares the engine."""

    def __init__(
        self, engine: AsyncEngine, params: SamplingParams, *, calls_per_episode: int = 1 << 16
    ) -> None:
        if params.n != 1:
            raise ValueError(f"an episode's model call samples one response; params.n is {params.n}")
        self.engine, self.params = engine, params
        self._calls = itertools.count()
        self._limit = calls_per_episode

    @property
    def max_context_tokens(self) -> int:
        return self.engine.max_context_tokens

    async def generate(self, token_ids: list[int], *, max_tokens: int, stop_token_ids=()) -> Completion:
        call = next(self._calls)
        if call >= self._limit:
            raise RuntimeError(f"an episode made more than {self._limit} model calls")
        params = replace(
            self.params,
            max_tokens=max_tokens,
            first_sequence=self.params.first_sequence + call,
            stop_token_ids=list(self.params.stop_token_ids) + list(stop_token_ids),
        )
        ids, logprobs, versions, finish = [], [], [], "length"
        async for out in self.engine.stream(token_ids, params, every_step=False):
            ids += out.token_ids
            logprobs += out.logprobs
            versions += [out.weight_version] * len(out.token_ids)
            finish = out.finish_reason or finish
        return Completion(ids, logprobs, finish, max(versions, default=0), versions)
