"""The Rollout role: sample responses for prompts through a backend (the native engine, hf or vllm)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from hybridflow.batch import Prompt, Rollouts
from hybridflow.parallel.weight_check import sample
from hybridflow.rollout.sampling import Generation, SamplingParams


class RolloutBackend(Protocol):
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Generation]: ...
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> object: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...


class Rollout:
    """Generates `params.n` responses per prompt; sequences of one prompt share a group id."""

    def __init__(self, backend: RolloutBackend, agent=None) -> None:
        """`agent`: an agent loop (hybridflow.agents): each sample is a multi-turn episode."""
        self.backend, self.agent = backend, agent

    def generate(self, prompts: list[Prompt], params: SamplingParams, *, first_group: int = 0) -> Rollouts:
        self.backend.wake()  # no-op unless the backend slept to give training its memory
        if self.agent is not None:
            from hybridflow.agents.setup import episodes_on

            episodes = episodes_on(self.backend, self.agent, prompts, params, first_group)
            rollouts = episodes.rollouts
            rollouts.scores = episodes.scores if any(s is not None for s in episodes.scores) else None
            return rollouts
        generations = self.backend.generate([p.token_ids for p in prompts], params)
        return Rollouts(
            prompt_ids=[prompts[g.prompt_index].token_ids for g in generations],
            response_ids=[g.token_ids for g in generations],
            response_logprobs=[g.logprobs for g in generations],
            finish_reasons=[g.finish_reason for g in generations],
            group_ids=[first_group + g.prompt_index for g in generations],
            prompts=[prompts[g.prompt_index] for g in generations],
            routed_experts=(
                [g.routed_experts for g in generations]
                if any(g.routed_experts is not None for g in generations)
                else None
            ),
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy trainer weights into the backend's model in place (nothing to copy when the backend
        runs the actor's own module)."""
        self.backend.update_weights(named_tensors)

    def sampled_weights(self, plan) -> dict[str, torch.Tensor] | None:
        """The planned elements of the backend's weights; None where it does not expose them (vLLM)."""
        if not hasattr(self.backend, "weight_tensors"):
            return None
        return sample(self.backend.weight_tensors(), plan)

    def sleep(self) -> None:
        """Free generation-only memory (the engine's KV cache) while the trainer runs."""
        self.backend.sleep()

    def wake(self) -> None:
        self.backend.wake()
