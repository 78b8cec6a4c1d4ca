"""Rotary position embeddings with the RoPE variants of these families (default, llama3, and the
others transformers defines, whose inverse frequencies we take from transformers itself)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from hybridflow.models.native.config import NativeConfig


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short kept, smooth in between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_mid, mid, scaled)


@lru_cache(maxsize=8)
def _inv_freq_cached(key: tuple) -> tuple[torch.Tensor, float]:
    head_dim, items = key[0], dict(key[1])
    theta, kind = items.get("rope_theta", 10000.0), items.get("rope_type", "default")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, items), 1.0
    if kind == "linear":
        return inv_freq / items["factor"], 1.0
    raise NotImplementedError(f"rope_type {kind!r}")


def inv_freq(config: NativeConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2], attention scaling)."""
    key = (
        config.head_dim,
        tuple(sorted((k, v) for k, v in config.rope.items() if not isinstance(v, (list, dict)))),
    )
    return _inv_freq_cached(key)


def rope_cos_sin(
    config: NativeConfig, position_ids: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, D] for positions [N] (computed in float32, then cast)."""
    freq, scaling = inv_freq(config)
    angles = position_ids.float()[:, None] * freq.to(position_ids.device)[None, :]  # [N, D/2]
    emb = torch.cat((angles, angles), dim=-1)  # [N, D]
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
