"""The Ray worker group: the same role class on N Ray actors (one per GPU, or per CPU slot), joined
in one torch.distributed group (NCCL on GPUs, gloo on CPUs), behind the worker-group `call`.

`call` runs a method on every worker and returns their results by rank. `call_split` splits a batch
across the data-parallel ranks (balanced by token work), runs the method on each shard and puts the
per-row results back in the batch's order. An exception in a worker surfaces here with its rank and
the worker's traceback; a worker that dies stops the run with a message saying which.
"""

from __future__ import annotations

import contextlib
import os
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridflow.batch import balance_partitions


class WorkerError(RuntimeError):
    """A role method raised in a worker; the message holds the rank and the worker's traceback."""


class _Worker:
    """One Ray actor: a torch.distributed rank holding one role object."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.role: Any = None

    def address(self) -> tuple[str, int]:
        """This worker's IP and a free port: rank 0 hosts the process group's rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), s.getsockname()[1]

    def init_process_group(self, master: tuple[str, int], backend: str) -> None:
        os.environ |= {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
        torch.distributed.init_process_group(backend, rank=self.rank, world_size=self.world_size)

    def build(self, factory: Callable[[int, int], Any]) -> None:
        self.role = factory(self.rank, self.world_size)

    def run(self, method: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
        try:
            return "ok", getattr(self.role, method)(*args, **kwargs)
        except Exception:  # reported to the controller with this rank
            return "error", traceback.format_exc()

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RayWorkerGroup:
    """`num_workers` Ray actors placed with one placement group (one CPU, plus one GPU each when
    `gpus`), each building its role with `factory(rank, world_size)` inside the process group."""

    def __init__(
        self,
        factory: Callable[[int, int], Any],
        *,
        num_workers: int,
        gpus: bool = False,
        ray_address: str | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """`timeout_s` bounds every call (None: wait as long as the work takes)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.timeout_s = timeout_s
        if not ray.is_initialized():
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
        bundle = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
        self.placement = placement_group([bundle] * num_workers, strategy="PACK")
        ray.get(self.placement.ready())
        actor = ray.remote(_Worker)
        self.workers = [
            actor.options(
                num_cpus=1,
                num_gpus=1 if gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, i),
            ).remote(i, num_workers)
            for i in range(num_workers)
        ]
        master = self._get([self.workers[0].address.remote()])[0]
        backend = "nccl" if gpus else "gloo"
        self._get([w.init_process_group.remote(master, backend) for w in self.workers])
        self._get([w.build.remote(factory) for w in self.workers])

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def _get(self, refs: list) -> list:
        import ray

        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerError(
                f"the workers did not finish within {self.timeout_s} s (a collective that some rank "
                "never reached?)"
            ) from e
        except ray.exceptions.RayActorError as e:
            rank = next((i for i, r in enumerate(refs) if _failed(r)), "?")
            raise WorkerError(
                f"worker rank {rank} died ({type(e).__name__}); the run stops here — resume from the "
                "last checkpoint"
            ) from e

    def _results(self, refs: list) -> list:
        out = []
        for rank, (status, value) in enumerate(self._get(refs)):
            if status == "error":
                raise WorkerError(f"worker rank {rank} raised:\n{value}")
            out.append(value)
        return out

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """The method on every worker with the same arguments; results by rank."""
        return self._results([w.run.remote(method, args, kwargs) for w in self.workers])

    def call_each(self, method: str, per_rank: list[tuple], **kwargs: Any) -> list[Any]:
        """`method(*per_rank[r], **kwargs)` on worker r; results by rank."""
        assert len(per_rank) == self.world_size
        return self._results([w.run.remote(method, args, kwargs) for w, args in zip(self.workers, per_rank)])

    def call_split(self, method: str, batch: Any, lengths: Sequence[int], **kwargs: Any) -> Any:
        """Split `batch` (anything with `select(rows)`) by data-parallel rank, balanced on `lengths`;
        run `method(shard, **kwargs)` on each worker. Tensor results (first dim = shard rows) come
        back as one tensor in the batch's row order; any other results as a list by rank."""
        parts = balance_partitions(list(lengths), self.world_size)
        refs = [w.run.remote(method, (batch.select(rows),), kwargs) for w, rows in zip(self.workers, parts)]
        results = self._results(refs)
        if not all(isinstance(r, torch.Tensor) for r in results):
            return results
        order = torch.tensor([i for rows in parts for i in rows])
        merged = torch.cat(results)  # rows in partition order
        return merged[torch.argsort(order)]

    def shutdown(self) -> None:
        import ray

        for w in self.workers:
            with contextlib.suppress(ray.exceptions.RayActorError):  # a dead worker needs no shutdown
                ray.get(w.shutdown.remote())
            ray.kill(w)
        ray.util.remove_placement_group(self.placement)


def _failed(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.RayActorError:
        return True
    except Exception:
        return False
    return False
