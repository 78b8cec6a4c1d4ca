"""Attention over the paged KV cache. Metadata comes in explicitly (no module globals).

Prefill runs the trainer's packed causal attention on the new tokens and stores their K/V; a job
that starts from cached pages (the prefix cache) attends its new tokens to the whole context instead.
Decode attends one query per sequence to its pages: a Triton kernel on CUDA, PyTorch elsewhere."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.models.native.model import PackedLayout, packed_causal_attention


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_cache/v_cache [S, Hkv, D] (one layer), slots [N] int64, k/v [N, Hkv, D]. On CUDA one Triton
    launch (deterministic whatever torch's settings), elsewhere index_copy_."""
    if k_cache.is_cuda:
        from hybridflow.engine.triton_layer import store_kv as store_kv_triton

        whole_rows = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
        store_kv_triton(
            k_cache, v_cache, slots, *((k, v) if whole_rows else (k.contiguous(), v.contiguous()))
        )
        return
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def prefill_attention(q, k, v, layout: PackedLayout) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] of packed new tokens -> [N, Hq, D]."""
    return packed_causal_attention(q, k, v, layout)


def prefix_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_bounds: list[int], k_bounds: list[int], cu=None
) -> torch.Tensor:
    """q [N, Hq, D]: each job's new tokens, the last ones of its context; k/v [M, Hkv, D]: each job's
    whole context (cached prefix + new). Causal with the queries at the end -> [N, Hq, D].
    cu: (cu_q, cu_k) int32 on the device, for CUDA's varlen attention (bottom-right causal)."""
    q_lens = [b - a for a, b in zip(q_bounds[:-1], q_bounds[1:])]
    k_lens = [b - a for a, b in zip(k_bounds[:-1], k_bounds[1:])]
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        groups = q.shape[1] // k.shape[1]
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return varlen_attn(q, k, v, cu[0], cu[1], max(q_lens), max(k_lens), window_size=(-1, 0))
    outs = []
    for qs, ks, vs, nq, nk in zip(
        torch.split(q, q_lens), torch.split(k, k_lens), torch.split(v, k_lens), q_lens, k_lens
    ):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (qs, ks, vs))  # [1, H, L, D]
        seen = (
            torch.arange(nk, device=q.device)[None, :] <= torch.arange(nk - nq, nk, device=q.device)[:, None]
        )
        outs.append(
            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seen, enable_gqa=True)[0].transpose(0, 1)
        )
    return torch.cat(outs)


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
    shape = (*slots.shape, *k_cache.shape[1:])  # [B, T, Hkv, D]; index_select: ~4x aten::index on CPU
    k = k_cache.index_select(0, slots.flatten()).view(shape).transpose(1, 2)  # [B, Hkv, T, D]
    v = v_cache.index_select(0, slots.flatten()).view(shape).transpose(1, 2)
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
