"""The stream of groups with the engines on rollout workers of their own (resources.rollout_workers,
an asynchronous run): each rollout worker runs a GroupStream over its engine; this controller-side
twin gives the trainer the same calls. A step's prompts are split over the workers in contiguous
runs (each group keeps the sampling streams it would have in one process); a thread here polls the
workers for finished groups and scores each as it arrives; a weight update is the placement's
broadcast, received by each worker between two engine steps.

A rollout worker that dies is replaced (resources.max_rollout_worker_replacements times in a run): a
new one in its place, the weight-sync group formed again, the current weights sent, and the groups
it had not handed over submitted to it again with their own sampling streams; the run goes on and
says so."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from hybridflow.agents.runner import CALLS_PER_EPISODE
from hybridflow.batch import Prompt, Rollouts
from hybridflow.controller.dispatch import prompt_shards
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.controller.ray_worker_group import WorkerDied
from hybridflow.controller.rollout_worker import RolloutWorker
from hybridflow.errors import UserError
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.stream.buffer import GroupBuffer

POLL_S = 0.02  # between polls of the rollout workers for finished groups


class RemoteGroupStream(GroupBuffer):
    def __init__(
        self,
        placement,
        reward,
        *,
        agent: bool,
        version: int,
        in_flight_updates: bool,
        deadline_s: float,
        max_replacements: int = 0,
    ) -> None:
        super().__init__(deadline_s)
        self.placement, self.group, self.reward = placement, placement.rollout, reward
        self.agent, self.version = agent, version
        self.in_flight_updates, self.max_replacements = in_flight_updates, max_replacements
        self.replaced = 0  # rollout workers replaced in this run
        self._recovered = {"async/rollout_workers_replaced": 0.0, "async/groups_requeued": 0.0}  # since asked
        # per rollout worker, the groups it holds and has not handed over: id -> (prompt, params)
        self._holds: list[dict[int, tuple[Prompt, SamplingParams]]] = [
            {} for _ in range(self.group.world_size)
        ]
        self._members = threading.RLock()  # one use of the rollout workers at a time (a replacement)
        self.group.call(RolloutWorker.open_stream, version, in_flight_updates, deadline_s)
        self.scoring = threading.Lock()  # one scoring at a time: the groups polled, validation
        self._closed = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="hybridflow-poll-groups", daemon=True)
        self._poller.start()

    def submit(
        self, prompts: list[Prompt], params: SamplingParams, first_group: int, offset: int = 0
    ) -> None:
        """As GroupStream.submit, the prompts spread over the rollout workers."""
        params = replace(params, first_sequence=params.first_sequence + offset * self._stride(params))
        first_group += offset
        self._admitted(range(first_group, first_group + len(prompts)))
        runs = self._runs(prompts, params, first_group)
        with self._members:
            for rank, (part, run_params, first) in enumerate(runs):
                for i, prompt in enumerate(part):  # each group as it would be submitted alone
                    shifted = replace(
                        run_params, first_sequence=run_params.first_sequence + i * self._stride(params)
                    )
                    self._holds[rank][first + i] = (prompt, shifted)
            # a dead worker's replacement is given what it holds, these groups too: no second call
            self._recovering(lambda: self.group.call_each(RolloutWorker.stream_submit, runs), retry=False)

    def update_weights(self, write, version: int) -> float:
        """The actor's weights broadcast to every rollout worker, each putting them into its engine
        between two steps (`write` is the colocated path's and unused here); the longest wait. A
        worker found dead first is replaced first (one that dies during the broadcast stops the run:
        its peers may be waiting in the broadcast)."""
        with self._members:
            for rank in range(self.group.world_size):
                if not self.group.is_alive(rank):
                    self._replace(rank, None)
            units, dtype = self.placement.manifest
            receiving = self.group.submit_each(
                RolloutWorker.stream_receive_weights, [(units, dtype, version)] * self.group.world_size
            )
            self.placement.train.call(HybridWorker.sync_weights)
            waited = max(self.group.wait(receiving))
            self.version = version
            return waited

    def snapshot(self) -> None:
        """Groups on rollout workers are not kept in a checkpoint: a resume generates them again."""
        return None

    def run_in_engine(self, fn):
        raise NotImplementedError("the engines are on the rollout workers")

    def generate_now(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        runs = self._runs(prompts, params, 0)
        with self._members:
            parts = self._recovering(
                lambda: self.group.call_each(
                    RolloutWorker.stream_generate, [(part, p) for part, p, _ in runs]
                )
            )
        for (_, _, offset), part in zip(runs, parts):  # each worker numbered its groups from 0
            part.group_ids = [g + offset for g in part.group_ids]
        return Rollouts.concat(parts)

    def take_idle_seconds(self) -> float:
        """The rollout workers' idle time since the last call (the mean over them)."""
        with self._members:
            idle = self._recovering(lambda: self.group.call(RolloutWorker.stream_idle_seconds))
        return sum(idle) / len(idle)

    def take_recomputed_tokens(self) -> int:
        """The rollout workers' tokens prefilled again since the last call (their sum)."""
        with self._members:
            return sum(self._recovering(lambda: self.group.call(RolloutWorker.stream_recomputed_tokens)))

    def take_recovery_metrics(self) -> dict[str, float]:
        """Rollout workers replaced and groups submitted again since the last call."""
        with self._members:
            out, self._recovered = self._recovered, dict.fromkeys(self._recovered, 0.0)
        return out

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._poller.join(timeout=60)
        self.group.call(RolloutWorker.close_stream)

    # ---- a rollout worker that dies ----------------------------------------------------------------
    def _recovering(self, call, *, retry: bool = True):
        """`call()`; when a rollout worker turns out dead, it is replaced and (`retry`) the call made
        again. A training worker's death is not this stream's to mend: it stops the run."""
        while True:
            try:
                return call()
            except WorkerDied as e:
                if e.group is not self.group:
                    raise
                self._replace(e.rank, e)
                if not retry:
                    return None

    def _replace(self, rank: int, error: BaseException | None) -> None:
        if self.replaced >= self.max_replacements:
            raise UserError(
                f"rollout worker {rank} died and {self.replaced} of resources.max_rollout_worker_replacements="
                f"{self.max_replacements} replacements are used: the run stops"
            ) from error
        start = time.perf_counter()
        self.replaced += 1
        self.placement.replace_rollout_worker(rank)
        self.group.call_one(
            rank, RolloutWorker.open_stream, self.version, self.in_flight_updates, self.deadline_s
        )
        lost = sorted(self._holds[rank].items())
        for group_id, (prompt, params) in lost:  # the same sampling streams: the same samples
            self.group.call_one(rank, RolloutWorker.stream_submit, [prompt], params, group_id)
        self._recovered["async/rollout_workers_replaced"] += 1
        self._recovered["async/groups_requeued"] += len(lost)
        print(
            f"rollout worker {rank} died; replaced in {time.perf_counter() - start:.1f} s, its {len(lost)} "
            f"unfinished group(s) submitted again ({self.replaced} of "
            f"resources.max_rollout_worker_replacements={self.max_replacements} used)",
            flush=True,
        )

    # ----------------------------------------------------------------------------------------------
    def _runs(self, prompts: list[Prompt], params: SamplingParams, first_group: int) -> list[tuple]:
        """(prompts, params, first group) per rollout worker: contiguous runs of the prompts, each
        starting at its first prompt's sampling streams."""
        return [
            (
                part,
                replace(params, first_sequence=params.first_sequence + offset * self._stride(params)),
                first_group + offset,
            )
            for part, offset in prompt_shards(prompts, self.group.world_size)
        ]

    def _stride(self, params: SamplingParams) -> int:
        """Sampling streams a group takes (an episode takes CALLS_PER_EPISODE)."""
        return params.n * (CALLS_PER_EPISODE if self.agent else 1)

    def _poll(self) -> None:
        try:
            while not self._closed.wait(POLL_S):
                polled = []
                with self._members:
                    for rank in range(self.group.world_size):  # one at a time: a dead one loses no others'
                        done, _running = self._recovering(
                            lambda rank=rank: self.group.call_one(rank, RolloutWorker.stream_poll)
                        )
                        for group_id, _ in done:
                            self._holds[rank].pop(group_id, None)
                        polled += done
                for group_id, rollouts in polled:  # scored here as it arrives
                    with self.scoring:
                        outcomes = self.reward.outcomes(rollouts, self.reward.submit(rollouts))
                    self._done(group_id, rollouts, outcomes)
        except BaseException as e:  # a worker failed: the trainer hears it at take()
            self._failed(e)
