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
