"""Many episodes at once on one engine: each (prompt, sample) pair runs the agent loop as an asyncio
task, so a slow tool or environment never holds up the others' generation; the segments become
Rollouts with loss masks, grouped by prompt for GRPO."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, replace
from typing import Protocol

from hybridflow.agents.model import EngineModel
from hybridflow.agents.trajectory import Trajectory
from hybridflow.batch import Prompt, Rollouts
from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.rollout.sampling import SamplingParams

CALLS_PER_EPISODE = 1 << 16  # the stride between episodes' sampling streams


class AgentLoop(Protocol):
    async def run(self, sample: Prompt, model: EngineModel) -> Trajectory | list[Trajectory]: ...


@dataclass
class Episodes:
    rollouts: Rollouts
    """One row per segment (most episodes are one), with loss masks; group = the prompt."""
    scores: list[float | None]
    """Per row: the episode's reward when its loop gave one (every segment of an episode gets the
    whole episode's), else None (the reward role scores the row)."""
    episodes: list[list[Trajectory]]
    metrics: dict[str, float]


async def run_episodes(
    loop: AgentLoop,
    prompts: list[Prompt],
    engine: AsyncEngine,
    params: SamplingParams,
    *,
    first_group: int = 0,
) -> Episodes:
    """`params.n` episodes per prompt. Episode j of prompt i samples from the streams
    (seed, first_sequence + (i * n + j) * CALLS_PER_EPISODE + call), whatever else runs beside it."""
    base = params.seed if params.seed is not None else random.randrange(2**31 - 1)
    n = params.n
    tasks = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            first = params.first_sequence + (i * n + j) * CALLS_PER_EPISODE
            model = EngineModel(engine, replace(params, n=1, seed=base, first_sequence=first),
                                calls_per_episode=CALLS_PER_EPISODE)  # fmt: skip
            tasks.append(loop.run(prompt, model))
    results = await asyncio.gather(*tasks)
    episodes = [r if isinstance(r, list) else [r] for r in results]
    rows: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "response_logprobs",
                                             "finish_reasons", "group_ids", "prompts", "loss_masks")}  # fmt: skip
    scores: list[float | None] = []
    for e, segments in enumerate(episodes):
        prompt = prompts[e // n]
        outcome = [s.reward for s in segments if s.reward is not None]
        total = sum(outcome) + sum(r for s in segments for r in s.turn_rewards) if outcome else None
        for s in segments:
            rows["prompt_ids"].append(s.prompt_ids)
            rows["response_ids"].append(s.response_ids)
            rows["response_logprobs"].append(s.logprobs)
            rows["finish_reasons"].append(s.finish_reason if s is segments[-1] else "segment")
            rows["group_ids"].append(first_group + e // n)
            rows["prompts"].append(prompt)
            rows["loss_masks"].append(s.loss_mask)
            scores.append(total)
    return Episodes(Rollouts(**rows), scores, episodes, episode_metrics(episodes))


def episode_metrics(episodes: list[list[Trajectory]]) -> dict[str, float]:
    """agent/*: turns, tool calls and failures, segments (history rewrites), finish reasons."""
    count = max(len(episodes), 1)
    flat = [s for e in episodes for s in e]
    out = {
        "agent/episodes": float(len(episodes)),
        "agent/turns_mean": sum(s.turns for s in flat) / count,
        "agent/tool_calls_mean": sum(s.tool_calls for s in flat) / count,
        "agent/tool_failures_mean": sum(s.tool_failures for s in flat) / count,
        "agent/segments_mean": len(flat) / count,
        "agent/history_rewrites": float(len(flat) - len(episodes)),
        "agent/sampled_tokens_mean": sum(s.sampled_tokens for s in flat) / count,
    }
    reasons = Counter(e[-1].finish_reason for e in episodes)
    out |= {f"agent/finish/{k}": v / count for k, v in sorted(reasons.items())}
    return out
