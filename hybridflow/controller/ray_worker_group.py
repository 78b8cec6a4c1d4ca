"""The Ray worker group: the same role class on N Ray actors (one per GPU, or per CPU slot), joined
in one torch.distributed group (NCCL on GPUs, gloo on CPUs), behind the worker-group `call`.

`call` runs a method on every worker and returns their results by rank. `call_split` splits a batch
across the data-parallel ranks (balanced by token work), runs the method on each shard and puts the
per-row results back in the batch's order. An exception in a worker surfaces here with its rank and
the worker's traceback; a worker that dies stops the run with a message saying which.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridflow.batch import balance_partitions
from hybridflow.controller.dispatch import merge_rows
from hybridflow.controller.worker_group import (
    Method,
    WorkerDied,
    WorkerError,
    bound_method,
    free_address,
    method_name,
)
from hybridflow.errors import UserError

STARTUP_TIMEOUT_S = 300.0
"""How long a group may wait for its placement, and the least it gets to start and build its workers."""


WORKER_NICENESS = 0
"""The niceness of the workers of a Ray instance a run starts itself. Ray's own default is 15 (its daemons
stay responsive under load), which left a worker ~4% of a core beside the run's reward workers at 0 once
they were busy: a CPU loop in a worker 23x slower beside two of them on two cores, 1.9x at 0 (the fair
share). At 0 every process of the run is level (docs/benchmarks.md, "Ray workers' niceness")."""


def start_ray(address: str | None = None, **options: Any) -> None:
    """ray.init: a cluster at `address` (or RAY_ADDRESS) is joined as it is; a local one started here
    runs its workers at WORKER_NICENESS."""
    import ray

    if address is None and not os.environ.get("RAY_ADDRESS"):
        options["_system_config"] = {"worker_niceness": WORKER_NICENESS, **options.get("_system_config", {})}
    ray.init(address=address, include_dashboard=False, **options)


def _is_ray_worker(pid: int) -> bool:
    """Process `pid` is still a Ray worker (Ray titles them 'ray::...'): the id of one that died may
    belong to another process by now, which SIGUSR1 would end."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::")
    except OSError:
        return False


class _Worker:
    """One Ray actor: a torch.distributed rank holding one role object."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.role: Any = None
        # a controller that times out asks for every thread's stack (written to the worker's log)
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    def pid(self) -> int:
        return os.getpid()

    def location(self) -> tuple[str, int]:
        """(Ray node id, process id): where the controller can signal this worker from."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def niceness(self) -> int:
        return os.nice(0)

    def address(self) -> tuple[str, int]:
        """This worker's IP and a free port: rank 0 hosts the process group's rendezvous."""
        return free_address()

    def init_process_group(self, master: tuple[str, int], backend: str) -> None:
        os.environ |= {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
        device = None
        if backend == "nccl":  # bind this rank to its GPU before NCCL sees it
            import ray

            # Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPU (index 0 here), unless told not to
            visible_all = os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") == "1"
            device = torch.device("cuda", int(ray.get_gpu_ids()[0]) if visible_all else 0)
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(
            backend, rank=self.rank, world_size=self.world_size, device_id=device
        )

    def build(self, factory: Callable[[int, int], Any]) -> None:
        self.role = factory(self.rank, self.world_size)

    def run(self, method: str, args: tuple, kwargs: dict, *, own: bool = False) -> tuple[str, Any]:
        """The role's method (or, with `own`, this worker's), with an error as its traceback."""
        try:
            return "ok", bound_method(self if own else self.role, method)(*args, **kwargs)
        except Exception:  # reported to the controller with this rank
            return "error", traceback.format_exc()

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RayWorkerGroup:
    """`num_workers` Ray actors placed with one placement group (one CPU, plus one GPU each when
    `gpus`), each building its role with `factory(rank, world_size)` inside the process group."""

    in_process = False

    def __init__(
        self,
        factory: Callable[[int, int], Any],
        *,
        num_workers: int,
        gpus: bool = False,
        ray_address: str | None = None,
        timeout_s: float | None = None,
        start_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        """`timeout_s` bounds every call (None: wait as long as the work takes). Placing the workers
        waits at most `start_timeout_s`, and starting them (their processes, process group and roles)
        at least that long: on a loaded machine a worker's imports alone can outlast a short call
        bound, and the resources of a group just shut down come back a little later."""
        import ray
        from ray.util.placement_group import placement_group

        self.timeout_s = timeout_s
        self.last_call_failed = False
        """A rank raised, died or timed out in the last call: shutdown gives no grace period (the ranks
        left may be blocked in a collective for good)."""
        self.workers: list = []
        self.locations: list[tuple[str, int]] = []
        if not ray.is_initialized():
            start_ray(ray_address, log_to_driver=True)
        kind = "GPU" if gpus else "CPU"
        have = ray.cluster_resources().get(kind, 0)
        if have < num_workers:  # a placement group that cannot be placed would wait forever
            raise UserError(
                f"the Ray cluster has {have:g} {kind}s but the run asks for {num_workers} workers with one "
                f"{kind} each (trainer.n_gpus_per_node x trainer.nnodes, or resources.num_workers on CPU)"
            )
        bundle = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
        self.placement = placement_group([bundle] * num_workers, strategy="PACK")
        self.start_timeout_s = start_timeout_s  # never unbounded: other work may hold the resources
        try:  # resources held by other work (another group, another job) leave it waiting
            ray.get(self.placement.ready(), timeout=start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement)
            raise WorkerError(
                f"Ray could not place {num_workers} workers with one {kind} each within {start_timeout_s:g} s: "
                f"the cluster's {have:g} {kind}s are held by other work (ray status shows what)"
            ) from None
        self.factory, self.gpus = factory, gpus
        try:
            self.workers = [self._start(i, num_workers) for i in range(num_workers)]
            # asked now, while every worker is idle: a worker stuck in a call answers nothing
            self.locations = self._starting("location")
            self.niceness = max(self._starting("niceness"))  # the scheduler's view of them (Ray sets it)
            (master,) = self._starting("address", ranks=[0])
            self._starting("init_process_group", master, "nccl" if gpus else "gloo")
            self._starting("build", factory)
        except BaseException:  # the workers started so far would hold their CPUs/GPUs for good
            self.last_call_failed = True
            self.shutdown()
            raise

    def _starting(self, method: str, *args: Any, ranks: list[int] | None = None) -> list:
        """A start-up step of the workers (`ranks`, default all): `method` of _Worker itself, bounded
        by the start-up time rather than the call bound (a worker may still be importing)."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        within = None if self.timeout_s is None else max(self.timeout_s, self.start_timeout_s)
        refs = [self.workers[r].run.remote(method, args, {}, own=True) for r in ranks]
        return self._results(refs, ranks=ranks, within=within)

    def _start(self, rank: int, world_size: int):
        """The Ray actor of `rank`, in its bundle of the placement group."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return (
            ray.remote(_Worker)
            .options(
                num_cpus=1,
                num_gpus=1 if self.gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, rank),
            )
            .remote(rank, world_size)
        )

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def replace(self, rank: int) -> None:
        """A new worker in the place (and placement bundle) of rank `rank`, which died, its role built
        anew. It joins no process group: for workers that need none among themselves (rollout
        workers, each with a whole engine)."""
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.workers[rank])
        self.workers[rank] = self._start(rank, self.world_size)
        (self.locations[rank],) = self._starting("location", ranks=[rank])
        self._starting("build", self.factory, ranks=[rank])

    def is_alive(self, rank: int, answer_within_s: float = 60.0) -> bool:
        """The worker answers a trivial call within `answer_within_s`: its process is gone (Ray says so
        at once) or it is stuck, either way to be replaced. Not a few seconds: on a loaded machine a
        busy worker's answer can take that long, and replacing it would throw its groups away."""
        import ray

        try:
            ray.get(self.workers[rank].pid.remote(), timeout=answer_within_s)
        except Exception:  # dead (RayActorError) or not answering
            return False
        return True

    def call_one(self, rank: int, method: Method | str, *args: Any, own: bool = False, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` on worker `rank` alone (errors as for `call`)."""
        name = method if isinstance(method, str) else method_name(method)
        (value,) = self._results([self.workers[rank].run.remote(name, args, kwargs, own=own)], ranks=[rank])
        return value

    def _results(
        self, refs: list, ranks: list[int] | None = None, within: float | None | str = "call"
    ) -> list:
        """Each worker's value, in the order of `refs` (the workers' ranks, or `ranks`), within `within`
        seconds (by default the group's `timeout_s`). The first error is raised at once: the failed
        rank's peers may be blocked in a collective it will never reach, so waiting for them would hang."""
        import ray

        self.last_call_failed = True  # until every value is in
        ranks = list(range(len(refs))) if ranks is None else ranks
        rank_of = dict(zip(refs, ranks))
        position = {ref: i for i, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        pending = list(refs)
        limit = self.timeout_s if within == "call" else within
        deadline = None if limit is None else time.monotonic() + limit
        while pending:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                waiting = sorted(rank_of[r] for r in pending)
                self._dump_stacks()
                raise WorkerError(
                    f"worker ranks {waiting} did not finish within {limit} s (a collective that "
                    "some rank never reached?); their stacks are in the worker logs"
                )
            (ref,) = ready
            rank = rank_of[ref]
            try:
                status, value = ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise WorkerDied(
                    f"worker rank {rank} died ({type(e).__name__}); the run stops here — resume from the "
                    "last checkpoint",
                    rank,
                    self,
                ) from e
            if status == "error":
                raise WorkerError(f"worker rank {rank} raised:\n{value}")
            values[position[ref]] = value
        self.last_call_failed = False
        return values

    def _dump_stacks(self) -> None:
        """Have the workers on this node write every thread's stack to their logs (a signal: a worker
        stuck in a call answers no actor call; the process ids of other nodes mean nothing here)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        for node, pid in self.locations:
            if node == here and _is_ray_worker(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        """The method on every worker with the same arguments; results by rank."""
        return self.wait(self.submit_each(method, [args] * self.world_size, **kwargs))

    def call_each(self, method: Method, per_rank: list[tuple], **kwargs: Any) -> list[Any]:
        """`method(*per_rank[r], **kwargs)` on worker r; results by rank."""
        return self.wait(self.submit_each(method, per_rank, **kwargs))

    def submit_each(self, method: Method, per_rank: list[tuple], **kwargs: Any) -> list:
        """Start `method(*per_rank[r], **kwargs)` on worker r without waiting: `wait` collects it.
        For calls that meet another group in a collective (the weight-sync broadcast)."""
        assert len(per_rank) == self.world_size
        name = method_name(method)
        return [w.run.remote(name, args, kwargs) for w, args in zip(self.workers, per_rank)]

    def wait(self, pending: list) -> list[Any]:
        """The results of submitted calls, by rank (errors and timeouts as for `call`)."""
        return self._results(pending)

    def address(self) -> tuple[str, int]:
        """Rank 0's IP and a free port there, for a rendezvous it hosts."""
        (address,) = self._results([self.workers[0].run.remote("address", (), {}, own=True)])
        return address

    def call_split(self, method: Method, batch: Any, lengths: Sequence[int], **kwargs: Any) -> Any:
        """Split `batch` (anything with `select(rows)`) by data-parallel rank, balanced on `lengths`;
        run `method(shard, **kwargs)` on each worker. Tensor results (first dim = shard rows) come
        back as one tensor in the batch's row order; any other results as a list by rank."""
        parts = balance_partitions(list(lengths), self.world_size)
        results = self.call_each(method, [(batch.select(rows),) for rows in parts], **kwargs)
        if not all(isinstance(r, torch.Tensor) for r in results):
            return results
        return merge_rows(results, parts)

    def shutdown(self) -> None:
        import ray

        # every worker is asked at once; a stuck one (in a collective a failed peer never reached)
        # does not get to it within the grace period and is killed as it is, as is a dead one; after a
        # failed call there is no grace period: its ranks' next step may never come
        pending = [w.shutdown.remote() for w in self.workers]
        ray.wait(pending, num_returns=len(pending), timeout=0 if self.last_call_failed else 10)
        for w in self.workers:
            ray.kill(w)
        ray.util.remove_placement_group(self.placement)
