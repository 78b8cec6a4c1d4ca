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
    rows: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "response_logprobs", "finish_reasons",
                                             "group_ids", "prompts", "loss_masks", "agent_stats")}  # fmt: skip
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
            rows["agent_stats"].append(
                {"turns": s.turns, "tool_calls": s.tool_calls, "tool_failures": s.tool_failures,
                 "tool_seconds": sum(s.tool_seconds), "tool_seconds_max": max(s.tool_seconds, default=0.0),
                 "first_segment": float(s is segments[0])}
            )  # fmt: skip
            scores.append(total)
    rollouts = Rollouts(**rows)
    return Episodes(rollouts, scores, episodes, agent_metrics(rollouts))


def agent_metrics(rollouts: Rollouts) -> dict[str, float]:
    """agent/*: per episode, turns, tool calls and failures, segments (history rewrites), sampled
    tokens; a tool call's latency (mean, max); the share of each way episodes ended."""
    stats = rollouts.agent_stats or []
    episodes = max(sum(s.get("first_segment", 0.0) for s in stats), 1.0)
    masks = rollouts.masks()
    out = {
        "agent/episodes": episodes,
        "agent/turns_mean": sum(s.get("turns", 0) for s in stats) / episodes,
        "agent/tool_calls_mean": sum(s.get("tool_calls", 0) for s in stats) / episodes,
        "agent/tool_failures_mean": sum(s.get("tool_failures", 0) for s in stats) / episodes,
        "agent/segments_mean": len(stats) / episodes,
        "agent/sampled_tokens_mean": sum(sum(m) for m in masks) / episodes,
    }
    calls = sum(s.get("tool_calls", 0) for s in stats)
    if calls:  # latency of a call, its wait for a free slot included
        out["agent/tool_seconds_mean"] = sum(s.get("tool_seconds", 0.0) for s in stats) / calls
        out["agent/tool_seconds_max"] = max(s.get("tool_seconds_max", 0.0) for s in stats)
    ends = Counter(r for r in rollouts.finish_reasons if r != "segment")
    out |= {f"agent/finish/{k}": v / episodes for k, v in sorted(ends.items())}
    return out
