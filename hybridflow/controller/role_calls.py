"""The roles over the worker groups, as one step calls them: generation split into contiguous runs
of prompts, per-row results (log-probs, values) on balanced shares and gathered back in the batch's
order, updates on every worker's share of each mini-batch."""

from __future__ import annotations

import dataclasses

import torch

from hybridflow.batch import Rollouts, TrainingBatch
from hybridflow.config.schema import Config
from hybridflow.controller.dispatch import (
    merge_rows,
    minibatch_shards,
    prompt_shards,
    shard_rows,
    share,
    to_sequence_parallel_ranks,
)
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.controller.placement import Placement
from hybridflow.controller.worker_group import Method
from hybridflow.rollout.sampling import SamplingParams


class RoleCalls:
    def __init__(self, config: Config, placement: Placement) -> None:
        self.config = config
        self.placement = placement
        self.workers = placement.train  # the workers that hold actor, reference and critic

    def rollouts(self, prompts: list, params: SamplingParams, *, first_group: int = 0) -> Rollouts:
        """Each generator samples a contiguous run of the prompts; rollouts come back in prompt order.
        The ranks of one tensor-parallel engine (rollout.tensor_parallel_size) share a run."""
        generators = self.placement.generators
        tp = self.config.rollout.tensor_parallel_size
        shards = prompt_shards(prompts, generators.world_size // tp)
        per_engine = [
            (part, dataclasses.replace(params, first_sequence=offset * params.n), first_group + offset)
            for part, offset in shards
        ]
        per_rank = to_sequence_parallel_ranks(per_engine, tp)
        return Rollouts.concat(generators.call_each(HybridWorker.generate, per_rank)[::tp])

    def log_probs(self, batch: TrainingBatch) -> torch.Tensor:
        """The actor's log-probs of the response tokens [B, T] (the old policy's, before the update)."""
        return self.per_row(HybridWorker.log_probs, batch)

    def log_probs_and_routes(self, batch: TrainingBatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The old policy's log-probs [B, T] and each sequence's experts as that pass routed them
        (router replay R2)."""
        return self.per_row(HybridWorker.log_probs_and_routes, batch)

    def ref_log_probs(self, batch: TrainingBatch) -> torch.Tensor:
        """The reference policy's log-probs [B, T]."""
        return self.per_row(HybridWorker.ref_log_probs, batch)

    def values(self, batch: TrainingBatch) -> torch.Tensor:
        """The critic's values [B, T]."""
        return self.per_row(HybridWorker.values, batch)

    def update_actor(self, batch: TrainingBatch) -> dict[str, float]:
        return self.update(HybridWorker.update_actor, batch)

    def update_critic(self, batch: TrainingBatch, *, epochs: int) -> dict[str, float]:
        return self.update(HybridWorker.update_critic, batch, epochs=epochs)

    def per_row(self, method: Method, batch: TrainingBatch):
        """A per-row result ([B, T], a list of B, or a tuple of those) computed by the workers on their balanced shares of `batch`."""
        sp = self._same_data
        parts = shard_rows(batch, self.workers.world_size // sp)
        per_rank = to_sequence_parallel_ranks([(share(batch, rows),) for rows in parts], sp)
        return merge_rows(self.workers.call_each(method, per_rank)[::sp], parts)

    def update(self, method: Method, batch: TrainingBatch, **kwargs) -> dict[str, float]:
        """An update on every worker's share of each mini-batch; the metrics are global on every rank."""
        sp = self._same_data
        shards = minibatch_shards(
            batch, self.config.actor.sequences_per_update, self.workers.world_size // sp
        )
        per_rank = to_sequence_parallel_ranks([(s,) for s in shards], sp)
        return self.workers.call_each(method, per_rank, **kwargs)[0]

    @property
    def _same_data(self) -> int:
        """Consecutive ranks that get the same rows: a sequence- or tensor-parallel group."""
        return self.config.actor.sequence_parallel_size * self.config.actor.tensor_parallel_size

    def memory_metrics(self) -> dict[str, float]:
        """Peak GPU memory per phase, the largest over the workers (verl: perf/max_memory_allocated_gb)."""
        merged: dict[str, float] = {}
        for per_rank in self.placement.memory_metrics():
            for k, v in per_rank.items():
                merged[k] = max(merged.get(k, 0.0), v)
        if merged:
            merged["perf/max_memory_allocated_gb"] = max(merged.values())
        return merged
