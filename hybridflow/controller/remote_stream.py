"""The stream of groups with the engines on rollout workers of their own (resources.rollout_workers,
an asynchronous run): each rollout worker runs a GroupStream over its engine; this controller-side
twin gives the trainer the same calls. A step's prompts are split over the workers in contiguous
runs (each group keeps the sampling streams it would have in one process); a thread here polls the
workers for finished groups and scores each as it arrives; a weight update is the placement's
broadcast, received by each worker between two engine steps."""

from __future__ import annotations

import threading
from dataclasses import replace

from hybridflow.agents.runner import CALLS_PER_EPISODE
from hybridflow.batch import Prompt, Rollouts
from hybridflow.controller.dispatch import prompt_shards
from hybridflow.controller.group_stream import GroupBuffer
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.controller.rollout_worker import RolloutWorker
from hybridflow.rollout.sampling import SamplingParams

POLL_S = 0.02  # between polls of the rollout workers for finished groups


class RemoteGroupStream(GroupBuffer):
    def __init__(
        self, placement, reward, *, agent: bool, version: int, in_flight_updates: bool, deadline_s: float
    ) -> None:
        super().__init__(deadline_s)
        self.placement, self.group, self.reward = placement, placement.rollout, reward
        self.agent, self.version = agent, version
        self.group.call(RolloutWorker.open_stream, version, in_flight_updates, deadline_s)
        self.scoring = threading.Lock()  # one scoring at a time: the groups polled, validation
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="hybridflow-poll-groups", daemon=True)
        self._poller.start()

    def submit(self, prompts: list[Prompt], params: SamplingParams, first_group: int) -> None:
        self._admitted(range(first_group, first_group + len(prompts)))
        self.group.call_each(RolloutWorker.stream_submit, self._runs(prompts, params, first_group))

    def update_weights(self, write, version: int) -> float:
        """The actor's weights broadcast to every rollout worker, each putting them into its engine
        between two steps (`write` is the colocated path's and unused here); the longest wait."""
        units, dtype = self.placement.manifest
        receiving = self.group.submit_each(
            RolloutWorker.stream_receive_weights, [(units, dtype, version)] * self.group.world_size
        )
        self.placement.train.call(HybridWorker.sync_weights)
        waited = max(self.group.wait(receiving))
        self.version = version
        return waited

    def run_in_engine(self, fn):
        raise NotImplementedError("the engines are on the rollout workers")

    def generate_now(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        runs = self._runs(prompts, params, 0)
        parts = self.group.call_each(RolloutWorker.stream_generate, [(part, p) for part, p, _ in runs])
        for (_, _, offset), part in zip(runs, parts):  # each worker numbered its groups from 0
            part.group_ids = [g + offset for g in part.group_ids]
        return Rollouts.concat(parts)

    def take_idle_seconds(self) -> float:
        """The rollout workers' idle time since the last call (the mean over them)."""
        idle = self.group.call(RolloutWorker.stream_idle_seconds)
        return sum(idle) / len(idle)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._poller.join(timeout=60)
        self.group.call(RolloutWorker.close_stream)

    # ----------------------------------------------------------------------------------------------
    def _runs(self, prompts: list[Prompt], params: SamplingParams, first_group: int) -> list[tuple]:
        """(prompts, params, first group) per rollout worker: contiguous runs of the prompts, each
        starting at its first prompt's sampling streams."""
        stride = params.n * (CALLS_PER_EPISODE if self.agent else 1)
        return [
            (
                part,
                replace(params, first_sequence=params.first_sequence + offset * stride),
                first_group + offset,
            )
            for part, offset in prompt_shards(prompts, self.group.world_size)
        ]

    def _poll(self) -> None:
        try:
            while not self._closed.wait(POLL_S):
                for done, _running in self.group.call(RolloutWorker.stream_poll):
                    for group_id, rollouts in done:  # scored here as it arrives
                        with self.scoring:
                            outcomes = self.reward.outcomes(rollouts, self.reward.submit(rollouts))
                        self._done(group_id, rollouts, outcomes)
        except BaseException as e:  # a worker failed: the trainer hears it at take()
            self._failed(e)
