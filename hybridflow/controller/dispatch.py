"""How the controller splits work over data-parallel ranks and puts the results back together.

Rows of a batch go to ranks balanced by token work (`balance_partitions`); per-row results come back
in the batch's order. A training mini-batch is split the same way, one mini-batch at a time, so that
every rank's i-th mini-batch is its share of the same global mini-batch as in one process."""

from __future__ import annotations

from typing import Any

import torch

from hybridflow.batch import Prompt, TrainingBatch, balance_partitions


def sequence_lengths(batch: TrainingBatch) -> list[int]:
    return [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids, strict=True)]


def shard_rows(batch: TrainingBatch, world_size: int) -> list[list[int]]:
    """Row indices of each rank's share, balanced by token work."""
    if world_size == 1:
        return [list(range(len(batch)))]
    return balance_partitions(sequence_lengths(batch), world_size)


def share(batch: TrainingBatch, rows: list[int]) -> TrainingBatch:
    """A rank's share of `batch` (the batch itself when the share is all of it, as with one rank)."""
    return batch if len(rows) == len(batch) else batch.select(rows)


def merge_rows(results: list[Any], parts: list[list[int]]) -> Any:
    """Per-rank row results (tensors [rows, ...], lists of one item a row, tuples of them, or None) in
    the batch's order."""
    first = results[0]
    if len(results) == 1 or first is None:  # one rank holds every row, in order
        return first
    if isinstance(first, tuple):
        return tuple(merge_rows([r[i] for r in results], parts) for i in range(len(first)))
    if isinstance(first, list):
        merged: list = [None] * sum(map(len, parts))
        for rows, items in zip(parts, results, strict=True):
            for i, item in zip(rows, items, strict=True):
                merged[i] = item
        return merged
    width = max(r.shape[1] for r in results) if first.dim() > 1 else None
    if width is not None:  # each shard is trimmed to its own longest response
        results = [torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in results]
    order = torch.tensor([i for rows in parts for i in rows])
    return torch.cat(results)[torch.argsort(order)]


def minibatch_shards(
    batch: TrainingBatch, per_update: int | None, world_size: int
) -> list[list[TrainingBatch]]:
    """For each rank, its share of every mini-batch of `per_update` sequences (all of them: None)."""
    shards: list[list[TrainingBatch]] = [[] for _ in range(world_size)]
    for minibatch in batch.minibatches(per_update):
        for rank, rows in enumerate(shard_rows(minibatch, world_size)):
            shards[rank].append(share(minibatch, rows))
    return shards


def to_sequence_parallel_ranks(per_group: list, sp_size: int) -> list:
    """Per data-parallel group -> per rank: the P ranks of a sequence-parallel group share the
    group's arguments (rank r is in group r // P)."""
    return [args for args in per_group for _ in range(sp_size)]


def prompt_shards(prompts: list[Prompt], world_size: int) -> list[tuple[list[Prompt], int]]:
    """Contiguous runs of prompts per rank, with each run's first index (its first group id offset),
    so that concatenating the ranks' rollouts keeps the prompt order."""
    base, extra = divmod(len(prompts), world_size)
    out, start = [], 0
    for rank in range(world_size):
        end = start + base + (rank < extra)
        out.append((prompts[start:end], start))
        start = end
    return out
