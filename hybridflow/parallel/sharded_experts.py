"""Mixture-of-experts weights read from a transformers checkpoint into the native model's fused expert
tensors, each rank reading only the experts its shards hold (FSDP2, tensor or expert parallelism all
split the expert dimension). Checkpoints store every expert apart, Qwen3-MoE as
`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`, Mixtral as
`block_sparse_moe.experts.{e}.w1/w3/w2.weight` with its router at `block_sparse_moe.gate.weight`;
the native model fuses each layer's (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows then up rows;
`mlp.experts.down_proj` [E, H, I]; `mlp.gate.weight` [E, H]). A checkpoint holding the fused names
is read by name like any dense tensor (sharded_load.py)."""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridflow.errors import UserError

# Each fused tensor's per-expert parts, stacked along its dim 1, in the two layouts checkpoints use:
# (the layer's block name on disk, the parts' names).
_LAYOUTS = {
    "gate_up_proj": (("mlp", ("gate_proj", "up_proj")), ("block_sparse_moe", ("w1", "w3"))),
    "down_proj": (("mlp", ("down_proj",)), ("block_sparse_moe", ("w2",))),
}
_FUSED = re.compile(r"^(?P<layer>.+)\.mlp\.experts\.(?P<kind>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<layer>.+)\.mlp\.gate\.weight$")


def checkpoint_keys(path: Path) -> dict[str, Path]:
    """Each tensor name of the safetensors checkpoint at `path` -> the file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    keys: dict[str, Path] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            keys.update(dict.fromkeys(f.keys(), file))
    return keys


def expert_sources(name: str, keys: dict[str, Path], num_experts: int) -> str | list[list[str]] | None:
    """Where tensor `name` lies in a checkpoint that stores it otherwise: a fused expert tensor, per
    expert the names of its parts in the order they stack along dim 1; a Mixtral router, the name it
    has there; None when the checkpoint holds `name` itself or it is neither."""
    if name in keys:
        return None
    if router := _ROUTER.match(name):
        renamed = f"{router['layer']}.block_sparse_moe.gate.weight"
        return renamed if renamed in keys else None
    fused = _FUSED.match(name)
    if fused is None:
        return None
    for block, parts in _LAYOUTS[fused["kind"]]:
        stem = f"{fused['layer']}.{block}.experts"
        sources = [[f"{stem}.{e}.{part}.weight" for part in parts] for e in range(num_experts)]
        if all(k in keys for row in sources for k in row):
            return sources
    raise UserError(
        f"checkpoint lacks {name} and the per-expert tensors it is made of "
        f"(looked for {fused['layer']}.mlp.experts.0.gate_proj.weight and "
        f"{fused['layer']}.block_sparse_moe.experts.0.w1.weight): not a Qwen3-MoE or Mixtral checkpoint?"
    )


def pop_expert_tensors(state: dict[str, torch.Tensor], keys: dict[str, Path], num_experts: int) -> dict:
    """The entries of `state` whose tensors the checkpoint stores apart (taken out of `state`, which
    keeps what a by-name read fills), each with its sources (expert_sources)."""
    found = {}
    for name in list(state):
        sources = expert_sources(name, keys, num_experts)
        if sources is not None:
            found[name] = (state.pop(name), sources)
    return found


@torch.no_grad()
def read_expert_tensors(found: dict, keys: dict[str, Path]) -> None:
    """Fill each tensor of `found` (pop_expert_tensors) with this rank's slice of it, reading from the
    checkpoint only the experts and rows that slice covers; a part whose shape does not fit is refused
    by name (a prefix of a wider tensor would otherwise be read without a word)."""
    with ExitStack() as opened:
        files: dict[Path, object] = {}

        def part(key: str, shape: tuple[int, ...]):
            """The part `key`, lazily sliced; `shape` what it must be (None: any height)."""
            if keys[key] not in files:
                files[keys[key]] = opened.enter_context(safe_open(keys[key], "pt"))
            piece = files[keys[key]].get_slice(key)
            got = tuple(piece.get_shape())
            if len(got) != len(shape) or any(want not in (None, n) for want, n in zip(shape, got)):
                raise UserError(f"checkpoint tensor {key} has shape {got}; the model's config needs {shape}")
            return piece

        for name, (tensor, sources) in found.items():
            local, offset = _local_and_offset(tensor)
            if local.numel() == 0:
                continue
            if isinstance(sources, str):  # a router stored under another name
                rows, cols = (slice(o, o + n) for o, n in zip(offset, local.shape))
                local.copy_(part(sources, tuple(tensor.shape))[rows, cols])
                continue
            # local [e, r, c]: experts offset[0].., rows offset[1].. of the stacked parts, columns offset[2]..
            cols = slice(offset[2], offset[2] + local.shape[2])
            for i in range(local.shape[0]):
                start = 0  # the first stacked row of the part below
                for key in sources[offset[0] + i]:
                    piece = part(key, (None, tensor.shape[2]))
                    height = piece.get_shape()[0]
                    lo, hi = max(start, offset[1]), min(start + height, offset[1] + local.shape[1])
                    if lo < hi:
                        local[i, lo - offset[1] : hi - offset[1]].copy_(piece[lo - start : hi - start, cols])
                    start += height
                if start != tensor.shape[1]:
                    raise UserError(
                        f"checkpoint's experts for {name} stack to {start} rows; the model has {tensor.shape[1]}"
                    )


def _local_and_offset(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """The part of `tensor` this rank holds and where it starts in the whole tensor."""
    if not isinstance(tensor, DTensor):
        return tensor, (0,) * tensor.dim()
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(local.shape) != tuple(shape):
        raise RuntimeError(
            f"{tuple(local.shape)} held, {tuple(shape)} expected: a layout the read does not know"
        )
    return local, offset
