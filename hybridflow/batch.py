"""Typed containers passed between roles. Ragged (one list per sequence) or packed; never padded.

Shapes use B = sequences, N = total tokens of a packed micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum
from typing import Any

import torch


@dataclass
class Prompt:
    """One tokenized prompt with what its reward needs."""

    index: int
    """Row number in its dataset (0-based): stable across runs, used for data order and logging."""
    token_ids: list[int]
    data_source: str
    ground_truth: Any = None
    extra_info: dict = field(default_factory=dict)
    text: str = ""
    """The prompt as the model sees it (chat template applied)."""
    messages: list[dict] | str | None = None
    """The prompt before templating (chat messages or a string), for reward models with their own template."""


@dataclass
class Rollouts:
    """Responses sampled for prompts; every list has one entry per sequence (B entries)."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_logprobs: list[list[float]]
    """Log-prob of each sampled token under the sampling distribution, as the rollout saw it (0.0 on
    tokens the policy did not sample: see `loss_masks`)."""
    finish_reasons: list[str]
    """'stop' (EOS or stop token) or 'length' (hit max tokens)."""
    group_ids: list[int]
    """Sequences sampled from the same prompt share a group id (the prompt's position in the step)."""
    prompts: list[Prompt]
    """The prompt of each sequence (repeated n times for n samples)."""
    loss_masks: list[list[int]] | None = None
    """Per response token: 1 where the policy sampled it (trained), 0 where it did not (a tool's output,
    an environment's answer, the template's tokens between turns in a multi-turn episode). None: every
    response token was sampled (single-turn), the same as masks of ones."""
    scores: list[float | None] | None = None
    """Per sequence, the outcome reward its agent loop gave (an environment's), used instead of the
    reward function; None (a row or the whole field): the reward function scores it."""
    policy_versions: list[list[int]] | None = None
    """Per response token, the policy version that sampled it (the number of updates the engine's
    weights had; a sequence continued across an in-flight weight update carries two), -1 on tokens
    the policy did not sample. None: sampled by the policy that trains on it (a synchronous step)."""
    agent_stats: list[dict[str, float]] | None = None
    """Per sequence, its episode segment's counts (turns, tool_calls, tool_failures, segment), for
    the agent/* metrics; None for single-turn rollouts."""
    routed_experts: list[torch.Tensor | None] | None = None
    """Per sequence, the experts the engine routed each token but the last to in every MoE layer,
    [tokens - 1, MoE layers, k] (router replay, R3); None where not recorded."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def masks(self) -> list[list[int]]:
        """The loss mask of every response (ones where `loss_masks` is None)."""
        if self.loss_masks is not None:
            return self.loss_masks
        return [[1] * len(r) for r in self.response_ids]

    def sampled_ids(self) -> list[list[int]]:
        """Each response's tokens that the policy sampled (mask 1), in order: what the reward judges,
        so that a tool's or environment's text never earns the policy a score it did not write."""
        if self.loss_masks is None:
            return self.response_ids
        return [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(self.response_ids, self.loss_masks)]

    def select(self, keep: list[int]) -> Rollouts:
        """The sequences `keep`, every per-sequence field (fields() here: a new one is never dropped)."""
        picked = {}
        for f in fields(self):
            rows = getattr(self, f.name)
            picked[f.name] = None if rows is None else [rows[i] for i in keep]
        return Rollouts(**picked)

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        joined = {}
        for f in fields(Rollouts):
            if f.name in _OPTIONAL_ROWS and all(getattr(p, f.name) is None for p in parts):
                joined[f.name] = None
            elif f.name == "loss_masks":
                joined[f.name] = [m for p in parts for m in p.masks()]
            elif f.name in _OPTIONAL_ROWS:  # a part without them: its rows' neutral value
                empty = _OPTIONAL_ROWS[f.name]
                joined[f.name] = [
                    x for p in parts for x in (getattr(p, f.name) or [empty() for _ in range(len(p))])
                ]
            else:
                joined[f.name] = [x for p in parts for x in getattr(p, f.name)]
        return Rollouts(**joined)


_OPTIONAL_ROWS = {
    "loss_masks": None,
    "scores": lambda: None,
    "agent_stats": dict,
    "policy_versions": list,
    "routed_experts": lambda: None,
}  # None: whole field absent


@dataclass
class PackedMicroBatch:
    """Sequences concatenated into one token stream with their boundaries (no padding)."""

    input_ids: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [B + 1] int32, sequence b spans input_ids[cu[b]:cu[b+1]]
    indices: list[int]
    """Position of each packed sequence in the batch it came from."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pack_sequences(sequences: list[list[int]], indices: list[int] | None = None) -> PackedMicroBatch:
    """Concatenate token lists into one packed micro-batch."""
    lengths = [len(s) for s in sequences]
    if any(n == 0 for n in lengths):
        raise ValueError("cannot pack an empty sequence")
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    input_ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)  # [N]
    position_ids = torch.cat([torch.arange(n, dtype=torch.int64) for n in lengths])  # [N]
    return PackedMicroBatch(
        input_ids, position_ids, cu, list(range(len(sequences))) if indices is None else indices
    )


def plan_microbatches(
    lengths: list[int], max_tokens: int, max_sequences: int | None = None
) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `max_tokens` tokens (first-fit decreasing).

    A sequence longer than the budget gets a micro-batch of its own. Each micro-batch's indices are
    sorted, and micro-batches are ordered by their first index, so the plan is deterministic.
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            fits_seq = max_sequences is None or len(bins[b]) < max_sequences
            if lengths[i] <= free and fits_seq:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def plan_grouped_microbatches(
    prompt_ids: list[list[int]],
    response_lengths: list[int],
    max_tokens: int,
    max_sequences: int | None = None,
) -> list[list[int]]:
    """Like `plan_microbatches`, for packings that hold a prompt once for all its responses: the
    sequences of one prompt stay together (a group costs its prompt plus its responses) and are split
    only where a group outgrows the budget. First-fit decreasing over the groups (or their parts)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompt_ids):
        groups.setdefault(tuple(prompt), []).append(i)
    units: list[tuple[list[int], int]] = []  # (sequences, tokens when packed)
    for prompt, members in groups.items():
        part, tokens = [], len(prompt)
        for i in members:
            full = part and (
                tokens + response_lengths[i] > max_tokens
                or (max_sequences is not None and len(part) >= max_sequences)
            )
            if full:
                units.append((part, tokens))
                part, tokens = [], len(prompt)
            part.append(i)
            tokens += response_lengths[i]
        units.append((part, tokens))
    bins: list[list[int]] = []
    room: list[int] = []
    for part, tokens in sorted(units, key=lambda u: (-u[1], u[0][0])):
        for b, free in enumerate(room):
            fits_seq = max_sequences is None or len(bins[b]) + len(part) <= max_sequences
            if tokens <= free and fits_seq:
                bins[b] += part
                room[b] -= tokens
                break
        else:
            bins.append(list(part))
            room.append(max_tokens - tokens)
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


class GapScope(IntEnum):
    """Which rollout/trainer probability-gap metric a response token counts in
    (training/rollout_probs_diff{suffix}_*); 0 (not a member): none, the token was not sampled."""

    COUNTED = 1  # the whole batch's gap only (a token of an older policy in an asynchronous run)
    FRESH = 2  # also _fresh: sampled by the training policy over its own K/V (the numerics check)
    KEPT_KV = 3  # also _kept_kv: the training policy's token over K/V kept from older weights

    @property
    def suffix(self) -> str:
        return {GapScope.COUNTED: "", GapScope.FRESH: "_fresh", GapScope.KEPT_KV: "_kept_kv"}[self]


@dataclass
class TrainingBatch:
    """What the actor and critic train on: ragged token lists plus response-aligned scalars.

    Token-level tensors are [B, T] with T = the longest response; `response_mask` marks real tokens.
    Only these per-token scalars are padded; model inputs are built per micro-batch.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_mask: torch.Tensor  # [B, T] float
    advantages: torch.Tensor | None = None  # [B, T]
    old_logprobs: torch.Tensor | None = None  # [B, T]
    ref_logprobs: torch.Tensor | None = None  # [B, T]
    rollout_logprobs: torch.Tensor | None = None  # [B, T]
    returns: torch.Tensor | None = None  # [B, T] (critic)
    old_values: torch.Tensor | None = None  # [B, T] (critic)
    importance_weights: torch.Tensor | None = None  # [B, T] truncated IS weights (rollout mismatch)
    routed_experts: list[torch.Tensor | None] | None = None  # per sequence [L - 1, MoE layers, k] (R3)
    gap_scopes: torch.Tensor | None = None
    """[B, T] int8 GapScope per token: the update measures the sampler's probabilities against its own
    forward before the step's first optimizer step (the gap metrics, where pi_old is not recomputed)."""

    def __len__(self) -> int:
        return len(self.response_ids)

    def minibatches(self, size: int | None) -> list[TrainingBatch]:
        """Consecutive mini-batches of `size` sequences (None: one of the whole batch)."""
        size = size or len(self)
        return [self.select(list(range(s, min(s + size, len(self))))) for s in range(0, len(self), size)]

    def select(self, rows: list[int]) -> TrainingBatch:
        """Rows `rows`, with token tensors trimmed to their longest response."""
        width = max((len(self.response_ids[i]) for i in rows), default=0)
        index = torch.tensor(rows, dtype=torch.long)

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index)[:, :width]

        return TrainingBatch(
            prompt_ids=[self.prompt_ids[i] for i in rows],
            response_ids=[self.response_ids[i] for i in rows],
            response_mask=pick(self.response_mask),
            advantages=pick(self.advantages),
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            rollout_logprobs=pick(self.rollout_logprobs),
            returns=pick(self.returns),
            old_values=pick(self.old_values),
            importance_weights=pick(self.importance_weights),
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in rows],
            gap_scopes=pick(self.gap_scopes),
        )


def pad_ragged(rows: list[list[float]] | list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Right-pad ragged float rows into [B, T] with zeros."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def balance_partitions(lengths: list[int], parts: int) -> list[list[int]]:
    """Split sequence indices into `parts` groups of near-equal work (data-parallel ranks), with work
    = L + L^2 / 4096 (linear layers plus attention). Greedy LPT: longest first onto the lightest group;
    the heaviest group is at most 4/3 of the optimum. Groups come back sorted by index."""
    work = [n + n * n / 4096 for n in lengths]
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-work[i], i)):
        g = min(range(parts), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += work[i]
    return [sorted(g) for g in groups]
