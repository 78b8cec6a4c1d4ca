"""Optimizer state kept in CPU memory between updates (`actor.offload_optimizer`): the GPU holds
Adam's moments only while a model is being updated, so generation gets that memory for its KV pool.
(Parameters, gradients and the optimizer step itself move to the CPU with FSDP2's CPU offload
instead: `apply_fsdp(offload_params=True)`.)"""

from __future__ import annotations

from contextlib import contextmanager

import torch

CPU = torch.device("cpu")


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Every per-parameter state tensor (Adam's moments) to `device`; scalar step counters stay
    where the optimizer keeps them (fused Adam wants them beside the parameters)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.device != device:
                state[key] = value.to(device, non_blocking=True)
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies land before the GPU memory is reused


@contextmanager
def optimizer_state_on(optimizer: torch.optim.Optimizer, device: torch.device, *, enabled: bool = True):
    """The optimizer's state on `device` for the block, in CPU memory before and after it."""
    if not enabled:
        yield
        return
    move_optimizer_state(optimizer, device)
    try:
        yield
    finally:
        move_optimizer_state(optimizer, CPU)
