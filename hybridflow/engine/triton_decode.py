"""Paged decode attention in Triton: one query token per sequence against its KV pages.

Grid (batch, kv head, split): each program takes the G query heads that share one KV head (packed
into one tile, padded to 16 rows so `tl.dot` applies), walks its share of the sequence's pages with
an online softmax, and writes a partial result; the splits are merged in PyTorch. The grid depends
only on shapes, so the kernel is captured in CUDA graphs; rows with no context produce zeros."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,
    table_ptr,  # [B, P] int32
    ctx_ptr,  # [B] int32
    acc_ptr,  # [B, Hkv, SPLITS, G_PAD, D] float32
    stat_ptr,  # [2, B, Hkv, SPLITS, G_PAD] float32: running max, sum of exponentials
    scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_tb,
    num_kv_heads,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
    SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D)
    offs = tl.arange(0, PAGE)
    q = tl.load(
        q_ptr + b * stride_qb + (h * G + rows)[:, None] * stride_qh + dims[None, :],
        mask=(rows < G)[:, None],
        other=0.0,
    )  # [G_PAD, D]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    s_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    # this split's pages that hold context: a loop with run-time bounds, which Triton pipelines
    first_page = split * PAGES_PER_SPLIT
    last_page = tl.minimum(first_page + PAGES_PER_SPLIT, tl.cdiv(ctx, PAGE))
    for logical in range(first_page, last_page):
        page = tl.load(table_ptr + b * stride_tb + logical).to(tl.int64)
        slots = page * PAGE + offs  # [PAGE]
        k = tl.load(k_ptr + slots[:, None] * stride_ks + h * stride_kh + dims[None, :])  # [PAGE, D]
        v = tl.load(v_ptr + slots[:, None] * stride_ks + h * stride_kh + dims[None, :])
        scores = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, PAGE]
        scores = tl.where((logical * PAGE + offs < ctx)[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    base = ((b * num_kv_heads + h) * SPLITS + split) * G_PAD
    tl.store(acc_ptr + (base + rows)[:, None] * D + dims[None, :], acc)
    tl.store(stat_ptr + base + rows, m)
    stride_stat = tl.num_programs(0) * num_kv_heads * SPLITS * G_PAD
    tl.store(stat_ptr + stride_stat + base + rows, s_sum)


def _splits(batch: int, kv_heads: int, pages: int) -> int:
    """Enough programs to fill the GPU when the batch is small; one split when it is large."""
    target = 264  # ~2 programs per SM on an H100/H200
    return max(1, min(pages, -(-target // max(batch * kv_heads, 1))))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [S, Hkv, D]; block_table [B, P] int32; context_lens [B] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    pages = block_table.shape[1]
    splits = _splits(b, hkv, pages)
    per_split = -(-pages // splits)
    q = q.contiguous()
    acc = torch.empty(b, hkv, splits, g_pad, d, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, b, hkv, splits, g_pad, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_table, context_lens, acc, stats, d**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0), hkv,
        G=g, G_PAD=g_pad, D=d, PAGE=page_size, PAGES_PER_SPLIT=per_split, SPLITS=splits,
    )  # fmt: skip
    m, s_sum = stats[0], stats[1]  # [B, Hkv, SPLITS, G_PAD]
    top = m.amax(dim=2, keepdim=True)
    weight = torch.where(s_sum > 0, torch.exp(m - top), torch.zeros_like(m))  # empty splits weigh 0
    out = (acc * weight[..., None]).sum(2) / (s_sum * weight).sum(2).clamp_min(1e-30)[..., None]
    return out[:, :, :g].reshape(b, hq, d).to(q.dtype)  # [B, Hq, D]
