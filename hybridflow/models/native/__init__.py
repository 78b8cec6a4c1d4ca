"""Our own Llama/Mistral/Qwen2/Qwen3 model (padding-free) and its HF conversion."""

from __future__ import annotations

import torch

from hybridflow.batch import pack_sequences
from hybridflow.models.native.config import SUPPORTED, NativeConfig, from_hf
from hybridflow.models.native.heads import (
    NativeScoreModel,
    score_model_from_hf,
    to_hf_score_model,
    value_model_from_causal_lm,
)
from hybridflow.models.native.logprobs import chunked_token_logprobs
from hybridflow.models.native.model import NativeCausalLM, NativeModule

__all__ = [
    "SUPPORTED",
    "NativeCausalLM",
    "NativeConfig",
    "NativeModule",
    "NativeScoreModel",
    "chunked_token_logprobs",
    "from_hf_model",
    "score_model_from_hf",
    "sequence_log_probs",
    "supports",
    "to_hf_model",
    "to_hf_score_model",
    "value_model_from_causal_lm",
]


def supports(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) in SUPPORTED and not (
        hf_config.model_type == "mistral" and getattr(hf_config, "sliding_window", None)
    )


def from_hf_model(hf_model, *, share: bool = False) -> NativeCausalLM:
    """Our model with the same weights as a transformers model of a supported family: a copy, or
    with `share` the same tensors (no second copy while a loaded model is converted on the CPU and
    moved: `.to(device)` then gives ours tensors of its own)."""
    config = from_hf(hf_model.config)
    dtype = next(hf_model.parameters()).dtype
    with torch.device("meta"):
        model = NativeCausalLM(config)
    state = {k: v.detach() for k, v in hf_model.state_dict().items() if "rotary_emb" not in k}
    if share:
        model.load_state_dict(state, strict=True, assign=True)
    else:
        model = model.to_empty(device=next(hf_model.parameters()).device).to(dtype)
        model.load_state_dict(state, strict=True)
    if config.tie_word_embeddings:  # one parameter under both names (assign set each name apart)
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config = getattr(hf_model, "generation_config", None)  # where generation stops
    return model.eval()


def to_hf_model(model: NativeCausalLM | dict[str, torch.Tensor], hf_config):
    """A transformers model holding our weights (for export with save_hf): from our model, or from
    its state dict (e.g. full weights gathered from FSDP shards)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.hf_filled import filled_hf_model

    return filled_hf_model(
        AutoModelForCausalLM, hf_config, model if isinstance(model, dict) else model.state_dict()
    )


def sequence_log_probs(
    model: NativeCausalLM, sequences: list[list[int]], *, chunk: int = 2048
) -> list[torch.Tensor]:
    """For each sequence, log p(token_t | tokens_<t) for t = 1..L-1 (packed, no padding)."""
    device = next(model.parameters()).device
    packed = pack_sequences(sequences)
    ids = packed.input_ids.to(device)
    hidden = model.hidden_states(ids, packed.position_ids.to(device), packed.cu_seqlens.to(device))  # [N, H]
    targets = torch.roll(ids, -1)  # next token; the last position of each sequence is dropped below
    logp, _ = chunked_token_logprobs(
        hidden, model.lm_head.weight, targets, chunk=chunk, exact=model.exact_kernels
    )
    bounds = packed.cu_seqlens.tolist()
    return [logp[s : e - 1] for s, e in zip(bounds[:-1], bounds[1:])]
