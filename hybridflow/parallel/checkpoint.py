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
    """Load `path` into `model` and `optimizer` in place, whatever the number of ranks that saved it.
    The optimizer must have state already (one step, or built with zeroed state)."""
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    with _quiet():
        dcp.load(state, checkpoint_id=str(path), no_dist=not torch.distributed.is_initialized())
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
