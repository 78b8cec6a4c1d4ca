"""Worker groups: how the controller reaches the workers that hold the roles. One interface, two
implementations: `InProcessWorkerGroup` (one worker in this process) and `RayWorkerGroup` (one Ray
actor per GPU or CPU slot, in one torch.distributed group). The controller's code is the same for both."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Protocol

Method = Callable[..., Any] | str
"""A worker method: the function itself as the worker class defines it (`HybridWorker.log_probs`), so a
rename or a typo fails where it is written; or its name, dotted for a method of a part the worker
holds (`stream_host.poll`: stream/host.py's `hosted`)."""


def method_name(method: Method) -> str:
    return method if isinstance(method, str) else method.__name__


def bound_method(worker: Any, method: Method) -> Callable[..., Any]:
    """The worker's method (or its part's, for a dotted name)."""
    return operator.attrgetter(method_name(method))(worker)


class WorkerError(RuntimeError):
    """A role method raised in a worker; the message holds the rank and the worker's traceback."""


class WorkerDied(WorkerError):
    """A worker's process is gone (killed, crashed, its node lost): `rank` of worker group `group`."""

    def __init__(self, message: str, rank: int, group: object = None) -> None:
        super().__init__(message)
        self.rank, self.group = rank, group


class WorkerGroup(Protocol):
    world_size: int
    in_process: bool  # its workers run in this process (a call that waits holds nothing remote up)
    niceness: int | None  # the CPU scheduler's niceness of its workers, where set apart from this process

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        """`method(*args, **kwargs)` on every worker; results by rank."""

    def call_each(self, method: Method, per_rank: list[tuple], **kwargs: Any) -> list[Any]:
        """`method(*per_rank[r], **kwargs)` on worker r; results by rank."""

    def address(self) -> tuple[str, int]:
        """Where rank 0 can host a rendezvous: its IP and a free port."""

    def shutdown(self) -> None: ...


class InProcessWorkerGroup:
    """One worker, built here with `factory(rank=0, world_size=1)`: calls are direct method calls."""

    world_size = 1
    in_process = True  # its calls run here: a call may wait without holding a remote worker up
    niceness = None  # this process's: nothing set apart (RayWorkerGroup: what Ray runs its workers at)

    def __init__(self, factory: Callable[[int, int], Any]) -> None:
        self.worker = factory(0, 1)

    def call(self, method: Method, *args: Any, **kwargs: Any) -> list[Any]:
        return [bound_method(self.worker, method)(*args, **kwargs)]

    def call_each(self, method: Method, per_rank: list[tuple], **kwargs: Any) -> list[Any]:
        (args,) = per_rank
        return [bound_method(self.worker, method)(*args, **kwargs)]

    def call_one(self, rank: int, method: Method, *args: Any, **kwargs: Any) -> Any:
        return bound_method(self.worker, method)(*args, **kwargs)

    def submit_each(self, method: Method, per_rank: list[tuple], **kwargs: Any) -> list[Any]:
        """Runs at once (one worker: nothing to overlap); `wait` hands the results over."""
        return self.call_each(method, per_rank, **kwargs)

    def wait(self, pending: list[Any]) -> list[Any]:
        return pending

    def is_alive(self, rank: int) -> bool:
        return True

    def address(self) -> tuple[str, int]:
        return free_address()

    def shutdown(self) -> None:
        if hasattr(self.worker, "shutdown"):
            self.worker.shutdown()


def free_address() -> tuple[str, int]:
    """This host's IP (as Ray sees it, so other nodes can reach it) and a free port."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    try:
        import ray

        return ray.util.get_node_ip_address(), port
    except ImportError:
        return "127.0.0.1", port


def worker_count(resources, device) -> int:
    """All workers of the run: one per GPU (n_gpus_per_node x nnodes), or resources.num_workers on CPU."""
    return resources.n_gpus_per_node * resources.nnodes if device.type == "cuda" else resources.num_workers


def worker_group(
    resources,
    device,
    factory: Callable[[int, int], Any],
    *,
    count: int | None = None,
    in_process: bool = True,
) -> WorkerGroup:
    """`count` workers (default: all of them, `worker_count`): in process for one (unless
    `in_process` is False), otherwise Ray workers joined with NCCL on GPUs, gloo on CPUs."""
    cuda = device.type == "cuda"
    count = worker_count(resources, device) if count is None else count
    if count == 1 and in_process:
        return InProcessWorkerGroup(factory)
    from hybridflow.controller.ray_worker_group import RayWorkerGroup

    return RayWorkerGroup(
        factory,
        num_workers=count,
        gpus=cuda,
        ray_address=resources.ray_address,
        timeout_s=resources.worker_timeout_s,
    )
