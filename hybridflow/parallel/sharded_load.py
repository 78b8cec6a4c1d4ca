"""A model read shard by shard: built on the meta device, split by the plans a loaded model gets
(tensor parallel, expert parallel, then FSDP2), then each rank reads from the checkpoint's
safetensors only the slices its shards hold (torch.distributed.checkpoint's
HuggingFaceStorageReader): no rank holds the whole model at any time. The native model keeps
transformers' parameter names, so a dense family's checkpoint maps one to one; MoE checkpoints store
each expert apart where ours are fused: those tensors are read expert by expert
(sharded_experts.py), each rank reading the experts it holds."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridflow.errors import UserError
from hybridflow.models.native import NativeCausalLM, supports
from hybridflow.models.native.config import NativeConfig, from_hf
from hybridflow.models.native.heads import NativeScoreModel
from hybridflow.parallel.sharded_experts import checkpoint_keys, pop_expert_tensors, read_expert_tensors


def safetensors_dir(path: str | None) -> Path | None:
    """`path` when it is a local transformers directory with safetensors weights, else None."""
    if not path:
        return None
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors")):
        return p
    return None


def shardable_config(path: Path) -> NativeConfig | None:
    """The native config of a checkpoint a sharded read can fill, or None (no native family)."""
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(path)
        config = from_hf(hf_config) if supports(hf_config) else None
    except (ValueError, KeyError, UserError):  # unreadable, or a variant the native model lacks
        return None
    return config


def load_sharded(
    path: Path,
    config: NativeConfig,
    dtype: torch.dtype,
    *,
    mesh,
    device: torch.device,
    tp_mesh=None,
    expert_parallel_size: int = 1,
    offload_params: bool = False,
    value_head: bool = False,
) -> NativeCausalLM | NativeScoreModel:
    """The checkpoint at `path` as a native model sharded over `mesh` (FSDP2; over `tp_mesh` first
    when given; an MoE model's experts split over groups of `expert_parallel_size` ranks of `mesh`
    before, when above 1), parameters in `dtype`, each rank holding and reading only its shards.
    `value_head`: the critic's model instead (the backbone read, a value head starting at zero, as
    `value_model_from_causal_lm` makes it from a whole policy)."""
    import torch.distributed.checkpoint as dcp

    from hybridflow.parallel import apply_fsdp

    with torch.device("meta"):
        model = (NativeScoreModel(config, 1, bias=True) if value_head else NativeCausalLM(config)).to(dtype)
    if tp_mesh is not None:
        from hybridflow.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh)
    if expert_parallel_size > 1 and config.moe is not None:
        from hybridflow.parallel.expert import apply_expert_parallel

        apply_expert_parallel(model, mesh, expert_parallel_size)
    apply_fsdp(model, mesh, offload_params=offload_params)
    # offloaded shards live in CPU memory (FSDP2 moves each layer in as it runs)
    model.to_empty(device=torch.device("cpu") if offload_params else device)
    state = model.state_dict()
    if config.tie_word_embeddings:  # one tensor under two names; the file holds it as the embedding
        state.pop("lm_head.weight", None)
    for name in [k for k in state if k.startswith("score.")]:  # not in the policy's file: zero
        state.pop(name).to_local().zero_()
    if config.moe is not None:  # its experts read apart, the rest by name
        keys = checkpoint_keys(path)
        read_expert_tensors(pop_expert_tensors(state, keys, config.moe.num_experts), keys)
    dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)))
    return model.eval()
