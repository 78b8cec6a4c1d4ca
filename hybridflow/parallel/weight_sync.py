"""The weight-sync group of a disaggregated rollout: the actor's rank 0 and every rollout worker in
a process group of their own (each side keeps its own torch.distributed world), over which the
actor's full weights are broadcast after each update — one FSDP unit (a decoder layer, then the
embedding, final norm and head) per broadcast, packed into one flat buffer."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(minutes=30)


class WeightSync:
    """Sync rank 0 (the actor's rank 0) hosts the rendezvous at `master`; ranks 1.. are the rollout
    workers. NCCL between GPUs, gloo between CPU processes."""

    def __init__(self, master: tuple[str, int], rank: int, size: int, device: torch.device) -> None:
        store = dist.TCPStore(master[0], master[1], size, is_master=rank == 0, timeout=TIMEOUT)
        prefixed = dist.PrefixStore("weight_sync", store)
        self.store = store  # the master's store must outlive the group
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(prefixed, rank, size)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, size, TIMEOUT)
        self.device = device

    def broadcast(self, flat: torch.Tensor) -> None:
        """`flat` from sync rank 0 into every other rank's `flat`, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([flat], options).wait()

    def send(self, flat: torch.Tensor, rank: int) -> None:
        """From sync rank 0 to one rollout worker (its slices of a unit: an engine split over workers)."""
        self.group.send([flat], rank, 0).wait()

    def receive(self, flat: torch.Tensor) -> None:
        """Into `flat`, from sync rank 0."""
        self.group.recv([flat], 0, 0).wait()


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat buffer [sum of numels] of tensors of one dtype."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Views of `flat` with the given shapes, in order."""
    sizes = [torch.Size(s).numel() for s in shapes]
    return [part.view(shape) for part, shape in zip(torch.split(flat, sizes), shapes)]
