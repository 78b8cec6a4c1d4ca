"""Read a transformers config of a supported family into the few numbers our model needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.errors import UserError

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class NativeConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    attention_output_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict = field(default_factory=dict)
    """rope_theta, rope_type and the type's own fields (factor, low_freq_factor, ...)."""
    max_position_embeddings: int = 4096


def rope_parameters(hf) -> dict:
    """transformers 5 keeps RoPE settings in `rope_parameters`; 4.x in rope_theta + rope_scaling."""
    params = getattr(hf, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params["rope_theta"] = getattr(hf, "rope_theta", 10000.0)
    return params


def from_hf(hf) -> NativeConfig:
    kind = hf.model_type
    if kind not in SUPPORTED:
        raise UserError(
            f"model type {kind!r} has no native implementation (supported: {', '.join(SUPPORTED)})"
        )
    if kind == "mistral" and getattr(hf, "sliding_window", None):
        raise UserError("mistral sliding-window attention is not supported natively; use model.impl=hf")
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    qwen2 = kind == "qwen2"
    return NativeConfig(
        model_type=kind,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_hidden_layers=hf.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        attention_bias=qwen2 or bool(getattr(hf, "attention_bias", False)),
        attention_output_bias=bool(getattr(hf, "attention_bias", False)) and not qwen2,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        qk_norm=kind == "qwen3",
        rope=rope_parameters(hf),
        max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
    )
