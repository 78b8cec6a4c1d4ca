"""Paged decode attention in Triton: one query token per sequence against its KV pages.

Grid (batch, kv head, split): each program takes the G query heads that share one KV head (packed
into one tile, padded to 16 rows so `tl.dot` applies) and walks its share of the sequence's context
BLOCK_N tokens at a time (a block may span pages: each token's slot comes from the page table) with
an online softmax. With one split (large batches: enough programs already) the program writes the
normalised output itself; with several (small batches, long contexts) each writes a partial result
and a second kernel merges them. The grids depend only on shapes, so both kernels are captured in
CUDA graphs; rows with no context produce zeros."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on the H200 with `bench/decode_attention.py` (docs/benchmarks.md).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
PROGRAMS_TARGET = 264  # ~2 programs per SM on an H100/H200: below this, contexts are split


@triton.jit(do_not_specialize=["stride_tb", "splits", "tokens_per_split"])
def _paged_decode_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [S, Hkv, D]
    v_ptr,
    table_ptr,  # [B, P] int32
    ctx_ptr,  # [B] int32
    out_ptr,  # [B, Hq, D]: written when SINGLE
    part_ptr,  # [B, Hkv, SPLITS, G_PAD, D] float32: written when not SINGLE
    stat_ptr,  # [2, B, Hkv, SPLITS, G_PAD] float32: running max, sum of exponentials
    scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_tb,
    stride_ob,
    stride_oh,
    num_kv_heads,
    splits,
    tokens_per_split,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
    SINGLE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D)
    offs = tl.arange(0, BLOCK)
    q = tl.load(
        q_ptr + b * stride_qb + (h * G + rows)[:, None] * stride_qh + dims[None, :],
        mask=(rows < G)[:, None],
        other=0.0,
    )  # [G_PAD, D]
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    s_sum = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)
    for first in range(start, end, BLOCK):  # run-time bounds: Triton pipelines the loads
        tokens = first + offs  # [BLOCK]
        valid = tokens < end
        page = tl.load(table_ptr + b * stride_tb + tokens // PAGE, mask=valid, other=0).to(tl.int64)
        slots = page * PAGE + tokens % PAGE
        kv_offs = slots[:, None] * stride_ks + h * stride_kh + dims[None, :]  # [BLOCK, D]
        k = tl.load(k_ptr + kv_offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv_offs, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, BLOCK]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if SINGLE:
        out = acc / tl.maximum(s_sum, 1e-30)[:, None]  # no context: acc 0, out 0
        out_offs = b * stride_ob + (h * G + rows)[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=(rows < G)[:, None])
    else:
        base = ((b * num_kv_heads + h) * splits + split) * G_PAD
        tl.store(part_ptr + (base + rows)[:, None] * D + dims[None, :], acc)
        tl.store(stat_ptr + base + rows, m)
        tl.store(stat_ptr + tl.num_programs(0) * num_kv_heads * splits * G_PAD + base + rows, s_sum)


@triton.jit(do_not_specialize=["splits"])
def _merge_splits_kernel(
    part_ptr,  # [B, Hkv, SPLITS, G_PAD, D] float32
    stat_ptr,  # [2, B, Hkv, SPLITS, G_PAD] float32
    out_ptr,  # [B, Hq, D]
    stride_ob,
    stride_oh,
    num_kv_heads,
    splits,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, G_PAD)
    dims = tl.arange(0, D)
    base = (b * num_kv_heads + h) * splits * G_PAD
    sum_base = tl.num_programs(0) * num_kv_heads * splits * G_PAD + base
    top = tl.full([G_PAD], float("-inf"), tl.float32)
    for s in range(0, splits):
        top = tl.maximum(top, tl.load(stat_ptr + base + s * G_PAD + rows))
    out = tl.zeros([G_PAD, D], tl.float32)
    denom = tl.zeros([G_PAD], tl.float32)
    for s in range(0, splits):
        m = tl.load(stat_ptr + base + s * G_PAD + rows)
        s_sum = tl.load(stat_ptr + sum_base + s * G_PAD + rows)
        weight = tl.where(s_sum > 0, tl.exp(m - top), 0.0)  # empty splits weigh 0
        denom += s_sum * weight
        part = tl.load(part_ptr + (base + s * G_PAD + rows)[:, None] * D + dims[None, :])
        out += part * weight[:, None]
    out = out / tl.maximum(denom, 1e-30)[:, None]
    out_offs = b * stride_ob + (h * G + rows)[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=(rows < G)[:, None])


def _split_tokens(batch: int, kv_heads: int, max_tokens: int, block: int, target: int) -> tuple[int, int]:
    """(splits, tokens per split): enough programs to fill the GPU when the batch is small, one
    split when it is large. Tokens per split are a multiple of the block."""
    blocks = max(1, -(-max_tokens // block))
    splits = max(1, min(blocks, -(-target // max(batch * kv_heads, 1))))
    blocks_per_split = -(-blocks // splits)
    return -(-blocks // blocks_per_split), blocks_per_split * block


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    page_size: int,
    *,
    block: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    programs_target: int = PROGRAMS_TARGET,
) -> torch.Tensor:
    """q [B, Hq, D]; k/v_cache [S, Hkv, D]; block_table [B, P] int32; context_lens [B] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    splits, tokens_per_split = _split_tokens(b, hkv, block_table.shape[1] * page_size, block, programs_target)
    out = torch.empty_like(q)
    if splits == 1:
        part = stats = out  # unused
    else:
        part = torch.empty(b, hkv, splits, g_pad, d, dtype=torch.float32, device=q.device)
        stats = torch.empty(2, b, hkv, splits, g_pad, dtype=torch.float32, device=q.device)
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, block_table, context_lens, out, part, stats, d**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), hkv, splits, tokens_per_split,
        G=g, G_PAD=g_pad, D=d, PAGE=page_size, BLOCK=block, SINGLE=splits == 1,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(b, hkv)](
            part, stats, out, out.stride(0), out.stride(1), hkv, splits, G=g, G_PAD=g_pad, D=d
        )
    return out  # [B, Hq, D]
