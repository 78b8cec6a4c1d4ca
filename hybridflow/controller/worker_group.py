"""Worker groups: how the controller reaches the workers that hold the roles. One interface, two
implementations: `InProcessWorkerGroup` (one worker in this process) and `RayWorkerGroup` (one Ray
actor per GPU or CPU slot, in one torch.distributed group). The controller's code is the same for both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class WorkerGroup(Protocol):
    world_size: int

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`method(*args, **kwargs)` on every worker; results by rank."""

    def call_each(self, method: str, per_rank: list[tuple], **kwargs: Any) -> list[Any]:
        """`method(*per_rank[r], **kwargs)` on worker r; results by rank."""

    def shutdown(self) -> None: ...


class InProcessWorkerGroup:
    """One worker, built here with `factory(rank=0, world_size=1)`: calls are direct method calls."""

    world_size = 1

    def __init__(self, factory: Callable[[int, int], Any]) -> None:
        self.worker = factory(0, 1)

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def call_each(self, method: str, per_rank: list[tuple], **kwargs: Any) -> list[Any]:
        (args,) = per_rank
        return [getattr(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        if hasattr(self.worker, "shutdown"):
            self.worker.shutdown()


def worker_group(resources, device, factory: Callable[[int, int], Any]) -> WorkerGroup:
    """In process for one worker; otherwise Ray workers (one per GPU: n_gpus_per_node x nnodes;
    on CPU: resources.num_workers, joined with gloo)."""
    cuda = device.type == "cuda"
    count = resources.n_gpus_per_node * resources.nnodes if cuda else resources.num_workers
    if count == 1:
        return InProcessWorkerGroup(factory)
    from hybridflow.controller.ray_worker_group import RayWorkerGroup

    return RayWorkerGroup(
        factory,
        num_workers=count,
        gpus=cuda,
        ray_address=resources.ray_address,
        timeout_s=resources.worker_timeout_s,
    )
