"""The few reductions over data-parallel ranks that the roles need; identities in one process.

With sequence or tensor parallelism the P ranks of a group hold the same data: a sum over all ranks
counts it P times, so the sums here divide by P, and the data-parallel size is the world size over P."""

from __future__ import annotations

import torch
import torch.distributed as dist

_SEQUENCE_PARALLEL = 1  # ranks per group holding the same data (parallel/ulysses.py, worker_models.py set it)


def set_sequence_parallel_size(size: int) -> None:
    """Ranks per group that hold the same data (a sequence- or tensor-parallel group)."""
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


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (the global norm, every gradient scaled by one factor), also for
    parameters on different device meshes, which it refuses: under FSDP2 x tensor parallelism a
    layer's projections live on the (dp, tp) mesh and its norms on dp alone. Returns the norm, a
    plain tensor."""
    from torch.distributed.tensor import DTensor

    params = [p for p in parameters if p.grad is not None]
    meshes: dict = {}
    for p in params:
        meshes.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    if len(meshes) <= 1:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = []
    for grads in meshes.values():  # each mesh's norm, reduced over its ranks
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms))
    scale = min(1.0, max_norm / (total.item() + 1e-6))  # as clip_grad_norm_ computes it
    for grads in meshes.values():
        for grad in grads:
            grad.mul_(scale)
    return total
