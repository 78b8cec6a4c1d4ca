"""Sharded checkpoints with torch.distributed.checkpoint: each rank writes its own shards, and the
files reshard on load, so a run saved on N ranks resumes on M (or in one process).

Loading never runs code from the files: DCP unpickles its `.metadata` and loads non-tensor items
with `weights_only=False`, so the metadata is first read by an unpickler that admits only DCP's own
metadata classes, and non-tensor items load with `weights_only=True` (SafeLoadPlanner)."""

from __future__ import annotations

import enum
import io
import pickle
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element  # what DefaultLoadPlanner.load_bytes uses
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hybridflow.errors import UserError

# what DCP's .metadata pickle may name: its own metadata records, torch sizes/dtypes, paths
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def _metadata_enum_member(cls, name: str):
    """`getattr` as a pickle of DCP's metadata may call it: an enum member of DCP's own metadata
    (Python 3.11.2 pickles enum members as getattr(class, name); 3.11.7 by value), nothing else."""
    enum_of_dcp = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__ in _METADATA_MODULES
    if not enum_of_dcp or name not in cls.__members__:
        raise pickle.UnpicklingError(f"getattr({cls!r}, {name!r}) is not part of a checkpoint's metadata")
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _metadata_enum_member
        obj = (
            super().find_class(module, name)
            if module.split(".")[0] in ("torch", "pathlib", "collections")
            else None
        )
        allowed = (
            (module in _METADATA_MODULES and isinstance(obj, type))
            or (module, name) in _METADATA_GLOBALS
            or (module == "torch" and isinstance(obj, torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")
        return obj


def check_metadata(path: str | Path) -> None:
    """Read `path`/.metadata with an unpickler that admits only DCP's metadata: a planted pickle is
    refused (UserError naming the file) before DCP's own unpickling could run it."""
    file = Path(path) / ".metadata"
    try:
        with file.open("rb") as f:
            _MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise UserError(f"{path}: no .metadata (not a complete sharded checkpoint)") from e
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError) as e:
        raise UserError(f"{file}: refused, not loaded ({e})") from e


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items (optimizer steps, hyper-parameters) load with
    weights_only=True: plain data and tensors, never code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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
    check_metadata(path)
    with _quiet():
        dcp.load(state, checkpoint_id=str(path), planner=SafeLoadPlanner(),
                 no_dist=not torch.distributed.is_initialized())  # fmt: skip
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])


def saved_weight_names(path: str | Path) -> set[str]:
    """The model weight names a `save_sharded` checkpoint holds."""
    check_metadata(path)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {name.removeprefix("model.") for name in saved if name.startswith("model.")}


def load_model_weights(path: str | Path, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model weights `save_sharded` wrote to `path` (from any number of ranks), read in this
    process into tensors shaped like `like`'s; names the checkpoint does not hold are left out."""
    check_metadata(path)
    reader = dcp.FileSystemReader(str(path))
    saved = set(reader.read_metadata().state_dict_metadata)
    state = {"model": {name: torch.empty_like(t) for name, t in like.items() if f"model.{name}" in saved}}
    with _quiet():
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                 no_dist=not torch.distributed.is_initialized())  # fmt: skip
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
