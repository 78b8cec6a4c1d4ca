"""Write a model as an HF directory that `AutoModelForCausalLM.from_pretrained` loads as-is."""

from __future__ import annotations

import os
from pathlib import Path

from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from hybridflow.errors import UserError
from hybridflow.permissions import as_user_files


def save_hf(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
) -> Path:
    """Save config, safetensors weights, tokenizer (with chat template) and generation config.

    Refuses a non-empty `out_dir` unless `overwrite`, so nothing a user wrote is replaced by accident.
    """
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"export directory {out} is not empty; choose another or pass overwrite")
    out.mkdir(parents=True, exist_ok=True)
    if model.generation_config is None or not model.can_generate():
        model.generation_config = GenerationConfig.from_model_config(model.config)
    if model.generation_config.eos_token_id is None and tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    as_user_files(out)
    return out
