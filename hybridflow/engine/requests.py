"""What the engine's request API hands back (per step, each advanced sample's new tokens), and what a
request may start from (a sample's tokens from an earlier run)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.errors import UserError
from hybridflow.rollout.sampling import SamplingParams


@dataclass
class RequestOutput:
    """The tokens one sample of a request gained in one `Engine.step()`."""

    request_id: str
    sample: int
    """Which of the request's `params.n` samples (0-based)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    """Under the sampling distribution (after temperature / top-k / top-p)."""
    unscaled_logprobs: list[float] = field(default_factory=list)
    """Under the model's own distribution."""
    finish_reason: str | None = None
    """None while it runs; 'stop', 'length' or 'abort' on its last output."""
    weight_version: int = 0
    """The engine's weight version these tokens were sampled with (+1 at each update_weights)."""
    routed_experts: torch.Tensor | None = None
    """On the last output, with `record_routes`: the experts of every token of prompt and response
    but the last, in every MoE layer, [tokens - 1, MoE layers, k] int16 (router replay)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SampleSoFar:
    """One sample's response as far as an earlier run got (a checkpoint's groups in flight):
    `add_request(..., resume=)` continues it, drawing the tokens it would have drawn next (the noise
    is keyed by the sequence's seed and position), or keeps it as it is when it had finished."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


def check_request(
    name, prompt_token_ids: list[int], params: SamplingParams, max_context: int, vocab: int
) -> None:
    """A request the engine cannot run fails alone, before it is queued: a step it joined could
    otherwise stop the engine for every request (a token id past int64, a stop id past the vocabulary)."""
    if not prompt_token_ids or len(prompt_token_ids) >= max_context:
        raise UserError(
            f"prompt {name} has {len(prompt_token_ids)} tokens; the engine takes 1 to {max_context - 1} "
            f"(max_context_tokens={max_context})"
        )
    for what, ids in (("prompt", prompt_token_ids), ("stop_token_ids", params.stop_token_ids)):
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise UserError(
                f"request {name}: {what} holds a token id outside the vocabulary (0 to {vocab - 1})"
            )
    if params.n < 1 or params.max_tokens < 1:
        raise UserError(f"request {name}: n={params.n} and max_tokens={params.max_tokens} must be at least 1")
