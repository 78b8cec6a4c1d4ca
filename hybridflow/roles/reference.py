"""The Reference role: a frozen copy of the initial policy, for KL terms."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from hybridflow.batch import TrainingBatch
from hybridflow.models.lora import adapters_disabled
from hybridflow.roles.forward import in_step_microbatches, policy_logprobs, shares_prompts


class Reference:
    """Frozen policy; built only when a KL term (KL loss or KL in reward) is on."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_tokens_per_microbatch: int,
        compute_dtype: str,
        pad_token_id: int,
        device: torch.device | None = None,
        temperature: float = 1.0,
        adapters_off: bool = False,
    ) -> None:
        """`temperature`: the rollout's, as for the actor (the KL compares the same distributions).
        `adapters_off`: `model` is the LoRA-trained actor itself, and the reference is its base (the
        adapters switched off while it scores): no second copy of the weights."""
        self.adapters_off = adapters_off
        self.model = model if adapters_off else model.eval().requires_grad_(False)
        # the compute device: parameters offloaded to the CPU (FSDP2) still run there
        self.device = device or next(model.parameters()).device
        self.max_tokens = max_tokens_per_microbatch
        self.compute_dtype = compute_dtype
        self.pad_token_id = pad_token_id
        self.temperature = temperature

    @torch.no_grad()
    def log_probs(self, batch: TrainingBatch) -> torch.Tensor:
        """Log-prob [B, T] of every response token under the reference policy."""
        out = torch.zeros_like(batch.response_mask)
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        grouping = batch.prompt_ids if shares_prompts(self.model) else None
        for rows, padding in in_step_microbatches(lengths, self.max_tokens, None, prompt_ids=grouping):
            micro = batch.select(rows)
            with adapters_disabled(self.model) if self.adapters_off else nullcontext():
                lp, _ = policy_logprobs(
                    self.model, micro.prompt_ids, micro.response_ids, device=self.device,
                    compute_dtype=self.compute_dtype, pad_token_id=self.pad_token_id, temperature=self.temperature,
                )  # fmt: skip
            if not padding:
                out[rows, : lp.shape[1]] = lp.float().cpu()
        return out * batch.response_mask
