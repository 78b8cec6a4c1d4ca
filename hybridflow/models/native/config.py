"""Read a transformers config of a supported family into the few numbers our model needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.errors import UserError
from hybridflow.models.native.moe import MoEConfig

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


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
    moe: MoEConfig | None = None
    """Mixture-of-experts feed-forward layers (Qwen3-MoE, Mixtral); None: dense."""


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
    if kind in ("mistral", "mixtral") and getattr(hf, "sliding_window", None):
        raise UserError(f"{kind} sliding-window attention is not supported natively; use model.impl=hf")
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
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        rope=rope_parameters(hf),
        max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
        moe=moe_config(hf),
    )


def moe_config(hf) -> MoEConfig | None:
    layers = range(hf.num_hidden_layers)
    if hf.model_type == "mixtral":
        return MoEConfig(
            num_experts=hf.num_local_experts,
            top_k=hf.num_experts_per_tok,
            intermediate_size=hf.intermediate_size,
            norm_topk_prob=True,
            sparse_layers=tuple(layers),
            router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0)),
        )
    if hf.model_type == "qwen3_moe" and hf.num_experts > 0:
        dense = set(getattr(hf, "mlp_only_layers", None) or [])
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        return MoEConfig(
            num_experts=hf.num_experts,
            top_k=hf.num_experts_per_tok,
            intermediate_size=hf.moe_intermediate_size,
            norm_topk_prob=bool(hf.norm_topk_prob),
            sparse_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0),
            router_aux_loss_coef=float(getattr(hf, "router_aux_loss_coef", 0.0)),
        )
    return None
