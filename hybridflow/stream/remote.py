"""The stream of groups as the controller sees it, over the workers that own engines: the colocated
training workers (each generating on its own device, one of them in this process or several Ray
workers), or the rollout workers of a disaggregated placement (resources.rollout_workers). Each such
worker runs a GroupStream over its engine (stream/host.py); this twin gives StreamedBatches the
stream's calls. A step's prompts are split over the workers in contiguous runs (each group keeps the
sampling streams it would have in one process); a thread here polls the workers for finished groups
and scores each as it arrives; a weight update is written into each engine between two of its steps
(colocated: each worker's own sync; rollout workers: the placement's broadcast).

Checkpoints: `snapshot()` gathers every worker's groups not handed over with the finished groups held
here, and a stream opened with `resume=` gives each worker that snapshot, to go on with the groups it
is given again.

A rollout worker that dies is replaced (resources.max_rollout_worker_replacements times in a run): a
new one in its place, the weight-sync group formed again, the current weights sent, and the groups
it had not handed over submitted to it again with their own sampling streams; the run goes on and
says so. A training worker that dies stops the run (its shards are gone)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import replace

from hybridflow.agents.runner import CALLS_PER_EPISODE
from hybridflow.batch import Prompt, Rollouts
from hybridflow.controller.dispatch import prompt_shards
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.controller.rollout_worker import RolloutWorker
from hybridflow.controller.worker_group import WorkerDied
from hybridflow.errors import UserError
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.stream.buffer import GroupBuffer, finished_records
from hybridflow.stream.host import StreamHost, hosted

POLL_S = 0.02  # between polls of the rollout workers for finished groups
CLOSE_WAIT_S = 5.0  # for the polling thread at close


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
        resume: dict | None = None,
        pause_for_training: bool = False,
        free_cache_while_paused: bool = False,
        max_replacements: int = 0,
        phase=None,
    ) -> None:
        """`placement`: whose generating workers (`placement.generators`) hold the engines; `reward`:
        scores each group polled; `resume`: a `snapshot()` of the run this one continues; the rest as
        GroupStream's (stream/local.py); `phase(name)`: the watchdog's, around each scoring."""
        super().__init__(deadline_s)
        self.placement, self.group, self.reward = placement, placement.generators, reward
        self.colocated = placement.rollout is None  # the training workers generate
        self.agent, self.version = agent, version
        self.in_flight_updates, self.max_replacements = in_flight_updates, max_replacements
        self._phase = phase or (lambda name: contextlib.nullcontext())
        self._opening = dict(in_flight_updates=in_flight_updates, deadline_s=deadline_s,
                             pause_for_training=pause_for_training, free_cache_while_paused=free_cache_while_paused)  # fmt: skip
        self.replaced = 0  # rollout workers replaced in this run
        self._recovered = {"async/rollout_workers_replaced": 0.0, "async/groups_requeued": 0.0}  # since asked
        # per rollout worker, the groups it holds and has not handed over: id -> (prompt, params)
        self._holds: list[dict[int, tuple[Prompt, SamplingParams]]] = [
            {} for _ in range(self.group.world_size)
        ]
        self._members = threading.RLock()  # one use of the rollout workers at a time (a replacement)
        self.group.call(hosted(StreamHost.open), version, resume=resume, **self._opening)
        self.scoring = threading.Lock()  # one scoring at a time: the groups polled, validation
        self._handing_over = threading.Lock()  # held while groups move from the workers to this buffer
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
            self._recovering(lambda: self.group.call_each(hosted(StreamHost.submit), runs), retry=False)

    def update_weights(self, write, version: int) -> float:
        """The actor's weights into every engine between two of its steps (`write` is GroupStream's and
        unused here): colocated, each worker's own sync; else the placement's broadcast to the rollout
        workers, a worker found dead first replaced first (one that dies during the broadcast stops the
        run: its peers may be waiting in it). The longest wait for groups in flight (one_step)."""
        with self._members:
            if self.colocated:
                waited = max(self.group.call(HybridWorker.stream_sync_weights, version))
            else:
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

    def run_until(self, group_ids: list[int]) -> None:
        """Engines that pause for training generate until these groups have finished (each worker
        the ones it holds)."""
        if not self._opening["pause_for_training"]:
            return
        wanted = set(group_ids)
        per_rank = [([g for g in holds if g in wanted],) for holds in self._holds]
        self.group.call_each(hosted(StreamHost.run_until), per_rank)

    def snapshot(self) -> dict | None:
        """Every admitted group not taken yet, as GroupStream.snapshot gives it: the workers' and the
        finished ones held here. None with an agent loop (its episodes start over)."""
        if self.agent:
            return None
        with self._handing_over, self._members:
            parts = self.group.call(hosted(StreamHost.snapshot))
            with self._changed:
                finished = {g: f.rollouts for g, f in self._finished.items()}
        groups = {int(g): samples for part in parts for g, samples in (part or {}).items()}
        groups |= {g: finished_records(r) for g, r in finished.items()}
        return {str(g): samples for g, samples in sorted(groups.items())}

    def generate_now(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        runs = self._runs(prompts, params, 0)
        with self._members:
            parts = self._recovering(
                lambda: self.group.call_each(hosted(StreamHost.generate), [(part, p) for part, p, _ in runs])
            )
        for (_, _, offset), part in zip(runs, parts):  # each worker numbered its groups from 0
            part.group_ids = [g + offset for g in part.group_ids]
        return Rollouts.concat(parts)

    def take_idle_seconds(self) -> float:
        """The engines' idle time since the last call (the mean over them)."""
        with self._members:
            idle = self._recovering(lambda: self.group.call(hosted(StreamHost.idle_seconds)))
        return sum(idle) / len(idle)

    def take_engine_counts(self) -> dict[str, int]:
        """The engines' counters since the last call (GroupStream.take_engine_counts), summed."""
        with self._members:
            counts = self._recovering(lambda: self.group.call(hosted(StreamHost.engine_counts)))
        return {k: sum(c.get(k, 0) for c in counts) for k in counts[0]} if counts else {}

    def take_recovery_metrics(self) -> dict[str, float]:
        """Rollout workers replaced and groups submitted again since the last call."""
        with self._members:
            out, self._recovered = self._recovered, dict.fromkeys(self._recovered, 0.0)
        return out

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        # a poll ends within POLL_S; a scoring that does not end (a reward that ignores its deadline, the
        # reason a run is stopping) is not waited for: the thread is a daemon, its groups are not needed
        self._poller.join(timeout=CLOSE_WAIT_S)
        self.group.call(hosted(StreamHost.close))

    # ---- a rollout worker that dies ----------------------------------------------------------------
    def _recovering(self, call, *, retry: bool = True):
        """`call()`; when a rollout worker turns out dead, it is replaced and (`retry`) the call made
        again. A training worker's death is not this stream's to mend: it stops the run."""
        while True:
            try:
                return call()
            except WorkerDied as e:
                if e.group is not self.group or self.colocated:  # a training worker's shards are gone
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
        self.group.call_one(rank, hosted(StreamHost.open), self.version, **self._opening)
        lost = sorted(self._holds[rank].items())
        for group_id, (prompt, params) in lost:  # the same sampling streams: the same samples
            self.group.call_one(rank, hosted(StreamHost.submit), [prompt], params, group_id)
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
        # a worker in this process is waited on (its groups are heard of as they finish); Ray workers
        # are asked every POLL_S (a call that waited would hold the worker from the trainer's calls)
        waits = self.group.in_process
        try:
            while not self._closed.is_set():
                if waits:
                    self.group.call_one(0, hosted(StreamHost.wait_finished), POLL_S)
                elif self._closed.wait(POLL_S):
                    break
                with self._handing_over:  # a snapshot sees each group on a worker or here, never between
                    polled = []
                    with self._members:
                        for rank in range(
                            self.group.world_size
                        ):  # one at a time: a dead one loses no others'
                            done, _running = self._recovering(
                                lambda rank=rank: self.group.call_one(rank, hosted(StreamHost.poll))
                            )
                            for group_id, _ in done:
                                self._holds[rank].pop(group_id, None)
                            polled += done
                    if polled:
                        self._score(polled)
        except BaseException as e:  # a worker failed: the trainer hears it at take()
            self._failed(e)

    def _score(self, polled: list[tuple[int, Rollouts]]) -> None:
        """The groups polled together, scored together (one call of the reward, as a whole batch is)."""
        together = Rollouts.concat([rollouts for _, rollouts in polled])
        with self.scoring, self._phase("reward"):
            outcomes = self.reward.outcomes(together, self.reward.submit(together))
        start = 0
        for group_id, rollouts in polled:
            self._done(group_id, rollouts, outcomes[start : start + len(rollouts)])
            start += len(rollouts)
