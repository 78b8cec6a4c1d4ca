"""Where the roles run. Colocated (the default, the hybrid engine): every worker holds actor,
reference, critic and a rollout engine on its GPU, and weights move into the engine in place.
Disaggregated (`resources.rollout_workers=N`): the last N workers hold only a rollout engine each,
generation runs there, and after each update the actor's rank 0 broadcasts the gathered weights to
them over a weight-sync group of their own (NCCL between GPUs, gloo on CPUs)."""

from __future__ import annotations

import functools

from hybridflow.config.schema import Config
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.controller.rollout_worker import RolloutWorker
from hybridflow.controller.worker_group import WorkerGroup, worker_count, worker_group
from hybridflow.errors import UserError
from hybridflow.parallel.weight_check import compare


class Placement:
    def __init__(
        self, config: Config, device, *, total_steps: int, kv_pool_tokens: int | None = None
    ) -> None:
        """`kv_pool_tokens`: the colocated engines' KV pool as the memory plan sized it (plan_run)."""
        c = config
        rollout_count = c.resources.rollout_workers
        train_count = worker_count(c.resources, device) - rollout_count
        if train_count < 1:
            raise UserError(
                f"resources.rollout_workers={rollout_count} leaves no worker for training out of "
                f"{worker_count(c.resources, device)} (trainer.n_gpus_per_node x trainer.nnodes, or "
                "resources.num_workers on CPU)"
            )
        factory = functools.partial(HybridWorker, c, total_steps=total_steps, kv_pool_tokens=kv_pool_tokens)
        # Ray hands out GPUs only to its own actors: next to Ray rollout workers, a lone trainer is a
        # Ray actor too, or both would be given the first GPU
        self.train: WorkerGroup = worker_group(
            c.resources,
            device,
            factory,
            count=train_count,
            in_process=not (rollout_count and device.type == "cuda"),
        )
        self.rollout: WorkerGroup | None = None
        if rollout_count:
            from hybridflow.controller.ray_worker_group import RayWorkerGroup
            from hybridflow.controller.rollout_worker import RolloutWorker

            self.rollout = RayWorkerGroup(
                functools.partial(RolloutWorker, c),
                num_workers=rollout_count,
                gpus=device.type == "cuda",
                ray_address=c.resources.ray_address,
                timeout_s=c.resources.worker_timeout_s,
            )
            self._join_weight_sync()
            if c.model.lora_rank or c.model.lora_adapter_path:  # the engines start from the base model
                self.sync_weights()

    def ray_niceness(self) -> int | None:
        """The niceness Ray runs this run's workers at (None: no Ray worker)."""
        found = [g.niceness for g in (self.train, self.rollout) if g is not None and g.niceness is not None]
        return max(found, default=None)

    @property
    def world_size(self) -> int:
        """Every worker of the run, training and rollout."""
        return self.train.world_size + (self.rollout.world_size if self.rollout is not None else 0)

    @property
    def generators(self) -> WorkerGroup:
        """The workers that generate: the rollout workers, or (colocated) every worker."""
        return self.rollout or self.train

    def _join_weight_sync(self) -> None:
        """The actor's rank 0 hosts the group; the rollout workers are its ranks 1..N. Both sides
        block until all have joined, so the rollout side is started first."""
        master, size = self.train.address(), self.rollout.world_size + 1
        slices = self.rollout.call(RolloutWorker.weight_slices)  # engines split over the workers: theirs
        slices = None if slices[0] is None else slices
        joining = self.rollout.submit_each(
            RolloutWorker.join_weight_sync, [(master, 1 + r, size) for r in range(self.rollout.world_size)]
        )
        self.train.call_each(
            HybridWorker.join_weight_sync,
            [(master, 0, size, slices) if r == 0 else (None, 0, size) for r in range(self.train.world_size)],
        )
        self.rollout.wait(joining)
        self.manifest = self.train.call(HybridWorker.weight_manifest)[0]

    def replace_rollout_worker(self, rank: int) -> None:
        """A new rollout worker in the place of `rank`, which died: the weight-sync group formed again
        with it, and the actor's current weights sent (the others receive and drop them). Only
        between weight updates: the caller holds every other use of the group off."""
        self.rollout.replace(rank)
        self._join_weight_sync()
        receiving = self.rollout.submit_each(
            RolloutWorker.receive_weights,
            [(*self.manifest, r == rank) for r in range(self.rollout.world_size)],
        )
        self.train.call(HybridWorker.sync_weights)
        self.rollout.wait(receiving)

    def sleep_rollout(self) -> None:
        """Colocated engines free their KV cache while the other roles run; own GPUs keep theirs."""
        if self.rollout is None:
            self.train.call(HybridWorker.sleep_rollout)

    def sync_weights(self) -> None:
        """The actor's current weights into every rollout engine."""
        if self.rollout is None:
            self.train.call(HybridWorker.sync_weights)
            return
        receiving = self.rollout.submit_each(
            RolloutWorker.receive_weights, [self.manifest] * self.rollout.world_size
        )
        self.train.call(HybridWorker.sync_weights)
        self.rollout.wait(receiving)

    def check_weight_sync(self, step: int) -> bool:
        """Sampled weights of the trainer and of every engine agree (WeightSyncMismatch otherwise);
        False where a backend does not expose its weights (vLLM): not checked."""
        results = self.train.call(HybridWorker.weight_samples, step)
        plan, trainer, _ = results[0]
        if self.rollout is None:
            engines = [(f"rank {r}'s rollout engine", engine) for r, (_, _, engine) in enumerate(results)]
        else:
            samples = self.rollout.call(RolloutWorker.sampled_weights, plan)
            engines = [(f"rollout worker {r}", engine) for r, engine in enumerate(samples)]
        if any(engine is None for _, engine in engines):
            return False
        for where, engine in engines:
            compare(trainer, engine, step=step, where=where)
        return True

    def memory_metrics(self) -> list[dict[str, float]]:
        """Every worker's peak memory per phase."""
        groups = [self.train] + ([self.rollout] if self.rollout is not None else [])
        return [m for group in groups for m in group.call(HybridWorker.take_memory_metrics)]

    def shutdown(self) -> None:
        self.train.shutdown()
        if self.rollout is not None:
            self.rollout.shutdown()
