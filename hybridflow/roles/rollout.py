"""The Rollout role: sample responses for prompts through a backend (hf now; native and vllm later)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from hybridflow.batch import Prompt, Rollouts
from hybridflow.rollout.hf import HFBackend
from hybridflow.rollout.sampling import SamplingParams


class Rollout:
    """Generates `params.n` responses per prompt; sequences of one prompt share a group id."""

    def __init__(self, backend: HFBackend) -> None:
        self.backend = backend

    def generate(self, prompts: list[Prompt], params: SamplingParams, *, first_group: int = 0) -> Rollouts:
        generations = self.backend.generate([p.token_ids for p in prompts], params)
        return Rollouts(
            prompt_ids=[prompts[g.prompt_index].token_ids for g in generations],
            response_ids=[g.token_ids for g in generations],
            response_logprobs=[g.logprobs for g in generations],
            finish_reasons=[g.finish_reason for g in generations],
            group_ids=[first_group + g.prompt_index for g in generations],
            prompts=[prompts[g.prompt_index] for g in generations],
        )

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy trainer weights into the backend's model in place. When the backend generates with the
        actor's own module (colocated in one process) there is nothing to copy."""
        params = dict(self.backend.model.named_parameters())
        for name, tensor in named_tensors:
            if params[name].data_ptr() != tensor.data_ptr():
                params[name].copy_(tensor)
