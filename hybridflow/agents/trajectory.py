"""What an episode leaves for training: the tokens the model saw and sampled, with a loss mask."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trajectory:
    """One segment of an episode: a prompt and everything after it, token for token as the model saw
    it. An episode whose history cannot stay one prefix (a chat template that rewrites earlier turns)
    is several segments; they share the episode's group and its final reward."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    """1 on the tokens the policy sampled, 0 on the rest (tool output, environment text, template)."""
    logprobs: list[float] = field(default_factory=list)
    """Sampling-distribution log-prob of each sampled token; 0.0 where the mask is 0."""
    weight_versions: list[int] = field(default_factory=list)
    """The engine's weight version each sampled token came from; -1 where the mask is 0."""
    turn_rewards: list[float] = field(default_factory=list)
    """Rewards given along the way (an environment's step rewards), one per model turn."""
    reward: float | None = None
    """The episode's outcome reward, if the loop knows it (an environment's); None: the reward role
    scores the policy's own tokens as for single-turn rollouts."""
    finish_reason: str = "stop"
    """'stop' (the model ended), 'length' (tokens or context ran out), 'max_turns', 'malformed'
    (a malformed tool call under the 'end' policy), 'error' (the environment failed)."""
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    tool_seconds: list[float] = field(default_factory=list)
    """Each tool call's latency (its wait for a free slot included)."""

    def add_sampled(self, token_ids: list[int], logprobs: list[float], weight_versions: list[int]) -> None:
        self.response_ids += token_ids
        self.loss_mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.weight_versions += weight_versions

    def add_observed(self, token_ids: list[int]) -> None:
        self.response_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.weight_versions += [-1] * len(token_ids)

    @property
    def sampled_tokens(self) -> int:
        return sum(self.loss_mask)

    def total_reward(self) -> float | None:
        """The outcome reward plus the step rewards (None when the loop gave no outcome reward)."""
        if self.reward is None:
            return None
        return self.reward + sum(self.turn_rewards)
