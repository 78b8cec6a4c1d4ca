"""What the engine's request API hands back (per step, each advanced sample's new tokens), and what a
request may start from (a sample's tokens from an earlier run)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.engine.sampled import params_key
from hybridflow.engine.sampler import step_keys
from hybridflow.engine.sequence import Sequence
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


def request_samples(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    resume: list[SampleSoFar | None] | None,
    *,
    first_seq_id: int,
    seed: int,
    max_context: int,
) -> list[Sequence]:
    """The `params.n` sequences of one request, ids from `first_seq_id`: sample j draws from the stream
    (seed, params.first_sequence + j), and with `resume[j]` starts from that sample's tokens so far
    (finished: kept as it is; its tokens then count as reported, its log-probs are never reported)."""
    resume = resume if resume is not None else [None] * params.n
    if len(resume) != params.n or all(r is not None and r.finish_reason for r in resume):
        raise ValueError(f"request {request_id!r}: resume needs one entry per sample and one to go on with")
    first = params.first_sequence
    seeds = step_keys(torch.full((params.n,), seed, dtype=torch.int64), torch.arange(first, first + params.n))
    group, end = params_key(params), min(len(prompt_token_ids) + params.max_tokens, max_context)
    samples = []
    for j, (key, so_far) in enumerate(zip(seeds.tolist(), resume)):
        s = Sequence(first_seq_id + j, 0, list(prompt_token_ids), len(prompt_token_ids), key,
                     request_id=request_id, sample=j, params=params, sampling_group=group, end=end)  # fmt: skip
        if so_far is not None:
            if not so_far.finish_reason and len(s.tokens) + len(so_far.token_ids) >= end:
                raise ValueError(f"request {request_id!r}: sample {j} has no room left to go on")
            s.tokens += so_far.token_ids
            s.logprobs, s.unscaled_logprobs = list(so_far.logprobs), list(so_far.logprobs)
            s.reported, s.finish_reason = len(so_far.token_ids), so_far.finish_reason
        samples.append(s)
    return samples
