"""Device and dtype names from config and CLI, resolved in one place."""

from __future__ import annotations

import os

import torch

from hybridflow.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """'auto' (cuda when present), 'cpu' or 'cuda'; asking for cuda without one is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the GPU: a copy from pageable memory larger than
    the driver's staging buffer blocks the host until the stream drains, so CUDA copies go through
    pinned memory (PyTorch's pinned-block cache, kept until the copy has run)."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def use_free_cores() -> str | None:
    """On the CPU, give torch as many threads as there are cores not already busy: a core shared
    with another busy process makes every one of torch's threads wait for the slowest (25-45x slower
    steps were seen on a loaded 2-core machine). Busy is measured now, over a quarter second (a load
    average lags by minutes). OMP_NUM_THREADS, when set, decides instead. Returns a line saying what
    was chosen when it is fewer than the cores, else None."""
    import os

    import psutil

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_core = psutil.cpu_percent(interval=0.25, percpu=True)  # this process sleeps meanwhile
    busy = sum(1 for load in per_core if load > 60)
    threads = max(1, min(cores, len(per_core) - busy))
    torch.set_num_threads(threads)
    if threads < cores:
        return (
            f"{cores - threads} of {cores} CPU cores are busy with other work: torch uses {threads} "
            "thread(s) (set OMP_NUM_THREADS to choose)"
        )
    return None


def expandable_cuda_segments() -> None:
    """CUDA memory in segments that grow and shrink (PyTorch's expandable_segments), unless the user
    configured the allocator or CUDA has started: with an engine generating beside the trainer, two
    streams' caches fragment fixed segments until memory the plan counted on is reserved but unusable
    (7 GiB of 140 in a long-tail streaming run on the H200)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
