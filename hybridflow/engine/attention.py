"""Attention over the paged KV cache. Metadata comes in explicitly (no module globals).

Prefill runs the trainer's packed causal attention on the new tokens (a prefill never has a cached
prefix: fresh prompts, or a preempted sequence recomputing everything) and stores their K/V.
Decode attends one query per sequence to its pages: a Triton kernel on CUDA, PyTorch elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.models.native.model import PackedLayout, packed_causal_attention


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_cache/v_cache [S, Hkv, D] (one layer), slots [N] int64, k/v [N, Hkv, D]."""
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def prefill_attention(q, k, v, layout: PackedLayout) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] of packed new tokens -> [N, Hq, D]."""
    return packed_causal_attention(q, k, v, layout)


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [S, Hkv, D]; block_table [B, P] int32; context_lens [B] -> [B, Hq, D].
    Gathers each sequence's pages (only as many as the longest context needs) and runs masked SDPA
    (PyTorch: the CPU path, and the Triton kernel's reference)."""
    pages = max(1, -(-int(context_lens.max()) // page_size))
    offsets = torch.arange(page_size, device=q.device)
    slots = (block_table[:, :pages].long()[:, :, None] * page_size + offsets).flatten(1)  # [B, T]
    k = k_cache[slots].transpose(1, 2)  # [B, Hkv, T, D]
    v = v_cache[slots].transpose(1, 2)
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < context_lens[:, None]  # [B, T]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=valid[:, None, None, :], enable_gqa=True
    )  # [B, Hq, 1, D]; rows with no context (padding) come out NaN
    return out[:, :, 0].nan_to_num(0.0)


def paged_decode_attention(q, k_cache, v_cache, block_table, context_lens, page_size: int) -> torch.Tensor:
    if q.is_cuda:
        from hybridflow.engine.triton_decode import paged_decode_attention_triton

        return paged_decode_attention_triton(q, k_cache, v_cache, block_table, context_lens, page_size)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_table, context_lens, page_size)
