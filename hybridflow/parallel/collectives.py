"""The few reductions over data-parallel ranks that the roles need; identities in one process.

With sequence parallelism the P ranks of a group hold the same data: a sum over all ranks counts it
P times, so the sums here divide by P, and the data-parallel size is the world size over P."""

from __future__ import annotations

import torch
import torch.distributed as dist

_SEQUENCE_PARALLEL = 1  # ranks per sequence-parallel group (parallel/ulysses.py sets it)


def set_sequence_parallel_size(size: int) -> None:
    global _SEQUENCE_PARALLEL
    _SEQUENCE_PARALLEL = size


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def data_parallel_scale() -> int:
    """What a rank multiplies its globally-normalised loss by, so that FSDP2's mean over ranks is the
    single-process gradient: the number of data-parallel ranks (1 without torch.distributed)."""
    return dist.get_world_size() // _SEQUENCE_PARALLEL if _distributed() else 1


def _all_reduce(values: list[float], op) -> list[float]:
    if not _distributed():
        return list(values)
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def sum_over_ranks(values: list[float]) -> list[float]:
    """Each value summed over the data-parallel ranks."""
    return [v / _SEQUENCE_PARALLEL for v in _all_reduce(values, dist.ReduceOp.SUM)]


def max_over_ranks(value: int) -> int:
    return int(_all_reduce([float(value)], dist.ReduceOp.MAX)[0])


def max_values_over_ranks(values: list[float]) -> list[float]:
    return _all_reduce(values, dist.ReduceOp.MAX)
