"""Sharded checkpoints with torch.distributed.checkpoint: each rank writes its own shards, and the
files reshard on load, so a run saved on N ranks resumes on M (or in one process)."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)


@contextmanager
def _quiet():
    """In one process DCP warns that it assumes a single-process save/load, which is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Model and optimizer state into the directory `path` (every rank calls this)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with _quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Load `path` into `model` and `optimizer` in place, whatever the number of ranks that saved it."""
    _init_optimizer_state(optimizer)  # the load fills existing state
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with _quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def saved_weight_names(path: str | Path) -> set[str]:
    """The model weight names a `save_sharded` checkpoint holds."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {name.removeprefix("model.") for name in saved if name.startswith("model.")}


def load_model_weights(path: str | Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model weights `save_sharded` wrote to `path` (from any number of ranks), read in this
    process into tensors shaped like `like`'s; names the checkpoint does not hold are left out."""
    reader = dcp.FileSystemReader(str(path))
    saved = set(reader.read_metadata().state_dict_metadata)
    state = {"model": {name: torch.empty_like(t) for name, t in like.items() if f"model.{name}" in saved}}
    with _quiet():
        dcp.load(state, storage_reader=reader, no_dist=not torch.distributed.is_initialized())
    return state["model"]


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam's state exists only after a step, and a sharded load fills existing state: take one step
    with zero gradients at learning rate 0 (no change to any weight; the load replaces the state)."""
    if optimizer.state:
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
