"""Gym-style environments for agent loops: `reset(sample)` and `step(action)`; the model's turns are
the actions, the environment's answers go back as user messages (not trained), and its rewards are
the episode's step rewards."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from hybridflow.agents.conversation import Conversation
from hybridflow.agents.tool_loop import prompt_messages
from hybridflow.agents.tools import DaemonThreads, call_with_deadline
from hybridflow.agents.trajectory import Trajectory
from hybridflow.batch import Prompt

REWARD_LIMIT = 1e30  # float32 holds ~3.4e38: sums and advantages need room above one reward
log = logging.getLogger(__name__)


class Environment(Protocol):
    def reset(self, sample: Prompt) -> str | None:
        """Start an episode for this sample; an observation to show before the first turn, or None."""

    def step(self, action: str) -> tuple[str | None, float, bool]:
        """The model's turn (its text) -> (observation or None, reward, done). May be async."""


def step_reward(value) -> float:
    """An environment's reward as a float, or ValueError: a string ("1.0 points"), NaN, inf or a
    value float32 cannot hold (1e39) would otherwise end the run later, blamed on the learning rate."""
    try:
        reward = float(value) if not isinstance(value, (str, bytes)) else None
    except (TypeError, ValueError):
        reward = None
    if reward is None:
        raise ValueError(f"the reward {value!r} is not a number")
    if not math.isfinite(reward) or abs(reward) > REWARD_LIMIT:
        raise ValueError(f"the reward {value!r} is not a finite number of at most {REWARD_LIMIT:g} in size")
    return reward


@dataclass
class EnvAgentLoop:
    """`await loop.run(sample, model)`: one fresh environment per episode (`make_env()`), turns until
    it says done, `max_turns` or `max_response_tokens`. The episode's reward is the sum of the step
    rewards. An environment that raises or misses `step_timeout_s` ends the episode ('error', its
    rewards so far); the error is counted, the run goes on."""

    tokenizer: object
    make_env: Callable[[], Environment]
    max_turns: int = 8
    max_tool_turns: int = 0
    """Environment answers per episode (0: no limit but max_turns); the model's turn after the last
    one is the episode's last (verl's max_user_turns)."""
    max_tokens_per_turn: int = 0
    """Most tokens of one model call (0: all the episode has left)."""
    max_response_tokens: int = 1024
    step_timeout_s: float = 30.0
    max_concurrent_steps: int = 64
    """Environment calls (reset, step) running at once over all episodes, each in a thread of the
    loop's own pool (asyncio's default has a handful)."""

    def __post_init__(self) -> None:
        self._threads = DaemonThreads(self.max_concurrent_steps, thread_name_prefix="agent-env")

    async def run(self, sample: Prompt, model) -> list[Trajectory]:
        env = self.make_env()
        messages = prompt_messages(sample)
        finish = "max_turns"
        try:
            first = await call_with_deadline(
                env.reset, sample, timeout_s=self.step_timeout_s, executor=self._threads
            )
        except Exception:
            first, finish = None, "error"
        if first is not None:
            messages.append({"role": "user", "content": first})
        conv = Conversation(self.tokenizer, messages)
        for turn_index in range(self.max_turns if finish != "error" else 0):
            turn = await conv.model_turn(model, self.max_response_tokens, self.max_tokens_per_turn)
            if turn is None:
                finish = "length"
                break
            text, _ = turn
            try:
                observation, reward, done = await call_with_deadline(
                    env.step, text, timeout_s=self.step_timeout_s, executor=self._threads
                )
                reward = step_reward(reward)
            except Exception as e:  # the environment's failure ends its episode (agent/finish/error)
                log.warning("an environment step failed, its episode ends: %s: %s", type(e).__name__, e)
                finish = "error"
                break
            conv.current.turn_rewards.append(reward)
            if done:
                finish = "stop"
                break
            if self.max_tool_turns and turn_index >= self.max_tool_turns:
                break  # 'max_turns': its answers are spent
            if conv.room(self.max_response_tokens, model.max_context_tokens) <= 0:
                finish = "length"
                break
            # (no observation: the template's prompt for the next turn alone)
            observed = [] if observation is None else [{"role": "user", "content": observation}]
            if not conv.add_messages(
                observed, room=conv.room(self.max_response_tokens, model.max_context_tokens)
            ):
                finish = "length"
                break
        for segment in conv.segments:
            segment.reward = 0.0  # the outcome is the step rewards (turn_rewards)
        conv.current.finish_reason = finish
        return conv.segments
