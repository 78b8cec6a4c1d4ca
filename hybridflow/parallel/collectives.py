"""The few reductions over data-parallel ranks that the roles need; identities in one process."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def data_parallel_scale() -> int:
    """What a rank multiplies its globally-normalised loss by, so that FSDP2's mean over ranks is the
    single-process gradient: the number of ranks (1 without torch.distributed)."""
    return dist.get_world_size() if _distributed() else 1


def _all_reduce(values: list[float], op) -> list[float]:
    if not _distributed():
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def sum_over_ranks(values: list[float]) -> list[float]:
    return _all_reduce(values, dist.ReduceOp.SUM)


def max_over_ranks(value: int) -> int:
    return int(_all_reduce([float(value)], dist.ReduceOp.MAX)[0])


def max_values_over_ranks(values: list[float]) -> list[float]:
    return _all_reduce(values, dist.ReduceOp.MAX)
