"""Device and dtype names from config and CLI, resolved in one place."""

from __future__ import annotations

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
