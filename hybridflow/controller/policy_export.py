"""A trained model as a transformers directory, whatever it is: ours (gathered from its FSDP shards,
a collective every rank joins), ours with LoRA adapters (gathered alike, merged, and the adapter in
PEFT's format beside it), or a transformers model under PEFT. The RL worker and the offline trainers both use it."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hybridflow.models import native, save_hf
from hybridflow.models.lora import is_peft, lora_modules, merged_state_dict, save_adapter


def export_policy(
    model: torch.nn.Module,
    directory: Path,
    *,
    hf_config,
    tokenizer,
    base_model: str,
    rank: int = 0,
    score: bool = False,
) -> None:
    """Rank 0 writes `model` to `directory` (a score model, `score`, as a sequence classifier); a
    LoRA model's adapter goes to directory.parent / "policy_adapter"."""
    if lora_modules(model):  # the merged policy, and the adapter in PEFT's format beside it
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_adapter(model, directory.parent / "policy_adapter", base_model=base_model, state=state)
            model = native.to_hf_model(merged_state_dict(model, state), hf_config)
    elif is_peft(model):  # a transformers model under PEFT: the same two, by PEFT
        model.save_pretrained(directory.parent / "policy_adapter")
        model = copy.deepcopy(model).merge_and_unload()
    elif isinstance(model, native.NativeModule):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            convert = native.to_hf_score_model if score else native.to_hf_model
            model = convert(state, hf_config)
    if rank != 0:
        return
    if score:
        model.save_pretrained(directory)
    else:
        save_hf(model, tokenizer, directory)
