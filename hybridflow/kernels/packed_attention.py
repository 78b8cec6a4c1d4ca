"""The trainer's exact attention over packed rows (sequence b: rows bounds[b]:bounds[b + 1], positions
from 0): the batch-invariant forward of kernels/attention.py reading the rows as pages of one token, and
a backward whose every gradient is summed in one fixed order, so a backward repeats to the bit: a key
block's dK/dV loops over the group's query heads and then the query blocks in order, a query block's dQ
over the key blocks in order. No atomics, no split of a sum over programs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from hybridflow.kernels.attention import BLOCK_M, BLOCK_N, WARPS, Tiles, paged_attention, split_runs
from hybridflow.kernels.launch import OPTIONS, UPCAST, dot


@triton.jit
def _block_probs(q, k, lse, i, j, scale, PRECISION: tl.constexpr):
    """Softmax probabilities [BLOCK_M, BLOCK_N] of queries at positions i over keys at j (causal; 0
    outside), from the forward's log2-sum-exp2."""
    s = dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), PRECISION, UPCAST) * scale
    p = tl.exp2(s - lse[:, None])
    return tl.where(j[None, :] <= i[:, None], p, 0.0)


@triton.jit
def _query_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, rows, head, valid, heads, stride_qn, stride_qh,
                stride_don, stride_doh, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):  # fmt: skip
    """One head's queries and output gradients [BLOCK_M, HEAD_PAD] at `rows`, and their forward
    log-sum-exp and rowsum(dO * O) [BLOCK_M] (zeros where not `valid`)."""
    d = tl.arange(0, HEAD_PAD)
    mask = valid[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head * stride_qh + d[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + rows[:, None] * stride_don + head * stride_doh + d[None, :], mask=mask, other=0.0)
    lse = tl.load(lse_ptr + rows * heads + head, mask=valid, other=0.0)
    delta = tl.load(delta_ptr + rows * heads + head, mask=valid, other=0.0)
    return q, do, lse, delta


@triton.jit
def _backward_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
                          block_row_ptr, block_first_ptr, block_count_ptr, block_length_ptr,
                          stride_qn, stride_qh, stride_kn, stride_kh, stride_don, stride_doh,
                          stride_dkn, stride_dkh, scale, sm_scale, heads,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dK, dV of one key block (program_id 0) of one KV head (program_id 1)."""
    block, kv_head = tl.program_id(0), tl.program_id(1)
    row0 = tl.load(block_row_ptr + block).to(tl.int64)  # the sequence's first row
    first = tl.load(block_first_ptr + block)
    count = tl.load(block_count_ptr + block)
    length = tl.load(block_length_ptr + block)
    d = tl.arange(0, HEAD_PAD)
    dims = d[None, :] < HEAD_DIM
    j = first + tl.arange(0, BLOCK_N)
    key_valid = tl.arange(0, BLOCK_N) < count
    at_k = (row0 + j)[:, None] * stride_kn + kv_head * stride_kh + d[None, :]
    k = tl.load(k_ptr + at_k, mask=key_valid[:, None] & dims, other=0.0)  # [BLOCK_N, HEAD_PAD]
    v = tl.load(v_ptr + at_k, mask=key_valid[:, None] & dims, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_PAD], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_PAD], tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for start in range(first, length, BLOCK_M):  # the queries that see this block
            i = start + tl.arange(0, BLOCK_M)
            query_valid = i < length
            q, do, lse, delta = _query_rows(
                q_ptr, do_ptr, lse_ptr, delta_ptr, row0 + i, head, query_valid, heads,
                stride_qn, stride_qh, stride_don, stride_doh, HEAD_DIM, HEAD_PAD)  # fmt: skip
            p = _block_probs(q, k, lse, i, j, scale, PRECISION)
            p = tl.where(query_valid[:, None], p, 0.0)
            dv = dot(tl.trans(p.to(do.dtype)), do, dv, PRECISION, UPCAST)
            dp = dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION, UPCAST)
            ds = p * (dp - delta[:, None])
            dk = dot(tl.trans(ds.to(q.dtype)), q, dk, PRECISION, UPCAST)
    at = (row0 + j)[:, None] * stride_dkn + kv_head * stride_dkh + d[None, :]
    tl.store(dk_ptr + at, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=key_valid[:, None] & dims)
    tl.store(dv_ptr + at, dv.to(dv_ptr.dtype.element_ty), mask=key_valid[:, None] & dims)


@triton.jit
def _backward_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
                        block_row_ptr, block_first_ptr, block_count_ptr,
                        stride_qn, stride_qh, stride_kn, stride_kh, stride_don, stride_doh,
                        stride_dqn, stride_dqh, scale, sm_scale, heads,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dQ of one query block (program_id 0) of one query head (program_id 1)."""
    block, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP
    row0 = tl.load(block_row_ptr + block).to(tl.int64)
    first = tl.load(block_first_ptr + block)
    count = tl.load(block_count_ptr + block)
    d = tl.arange(0, HEAD_PAD)
    dims = d[None, :] < HEAD_DIM
    i = first + tl.arange(0, BLOCK_M)
    query_valid = tl.arange(0, BLOCK_M) < count
    rows = row0 + i
    mask = query_valid[:, None] & dims
    q, do, lse, delta = _query_rows(
        q_ptr, do_ptr, lse_ptr, delta_ptr, rows, head, query_valid, heads,
        stride_qn, stride_qh, stride_don, stride_doh, HEAD_DIM, HEAD_PAD)  # fmt: skip
    dq = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    last = first + count - 1
    for start in range(0, last + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_mask = (j <= last)[:, None] & dims
        at_k = (row0 + j)[:, None] * stride_kn + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + at_k, mask=key_mask, other=0.0)
        v = tl.load(v_ptr + at_k, mask=key_mask, other=0.0)
        p = _block_probs(q, k, lse, i, j, scale, PRECISION)
        dp = dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq = dot(ds.to(k.dtype), k, dq, PRECISION, UPCAST)
    at = rows[:, None] * stride_dqn + head * stride_dqh + d[None, :]
    tl.store(dq_ptr + at, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=mask)


@dataclass
class PackedPages:
    """A packed batch (sequence b is rows bounds[b]:bounds[b + 1] of q, k and v) as pages of one token:
    table [B, longest] int32 of each sequence's rows and the forward's tiles over all its queries; the
    backward's key and query blocks are made when a backward first asks."""

    bounds: list[int]
    group: int
    table: torch.Tensor
    tiles: Tiles

    @functools.cached_property
    def backward_blocks(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(key blocks of BLOCK_N positions: first row, first position, count, sequence length;
        query blocks of BLOCK_M positions: first row, first position, count), [blocks] int32 each."""
        starts = np.asarray(self.bounds[:-1], dtype=np.int64)
        lengths = np.diff(np.asarray(self.bounds, dtype=np.int64))
        zeros, device = np.zeros_like(starts), self.table.device
        run, first, _, count = split_runs(zeros, starts, lengths, BLOCK_N, device)
        keys = [_on(starts, run), first, count, _on(lengths, run)]
        run, first, _, count = split_runs(zeros, starts, lengths, BLOCK_M, device)
        return keys, [_on(starts, run), first, count]

    def backward(self, q, k, v, out, lse, grad_out):
        return packed_attention_backward(q, k, v, out, lse, grad_out, self)


def _on(values: np.ndarray, index: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(values.astype(np.int32)).to(index.device)[index.long()]


def packed_pages(bounds: list[int], group: int, device) -> PackedPages:
    starts = np.asarray(bounds[:-1], dtype=np.int64)
    lengths = np.diff(np.asarray(bounds, dtype=np.int64))
    longest = int(lengths.max()) if len(lengths) else 0
    table = torch.from_numpy((starts[:, None] + np.arange(longest)[None, :]).astype(np.int32))
    tiles = Tiles.of_runs(np.zeros_like(starts), starts, lengths, group, device)
    return PackedPages(list(bounds), group, table.to(device, non_blocking=True), tiles)


def packed_attention_backward(q, k, v, out, lse, grad_out, pages: PackedPages):
    """Gradients (dq, dk, dv) of the packed causal attention, each summed in one fixed order (the
    same bits every run). lse: the forward's [N, Hq] float32."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    head_pad = max(16, triton.next_power_of_2(dim))
    sm_scale = dim**-0.5
    scale = sm_scale * 1.4426950408889634
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grad_out = grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)  # [N, Hq]: rowsum(dO * O)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    keys, queries = pages.backward_blocks
    meta = dict(GROUP=heads // kv_heads, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=dim, HEAD_PAD=head_pad,
                PRECISION=precision, num_warps=WARPS, **OPTIONS)  # fmt: skip
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), grad_out.stride(0), grad_out.stride(1))
    if keys[0].shape[0]:
        _backward_dkdv_kernel[(keys[0].shape[0], kv_heads)](
            q, k, v, grad_out, lse, delta, dk, dv, *keys, *strides, dk.stride(0), dk.stride(1),
            scale, sm_scale, heads, **meta,
        )  # fmt: skip
        _backward_dq_kernel[(queries[0].shape[0], heads)](
            q, k, v, grad_out, lse, delta, dq, *queries, *strides, dq.stride(0), dq.stride(1),
            scale, sm_scale, heads, **meta,
        )  # fmt: skip
    return dq, dk, dv


class _PackedAttention(torch.autograd.Function):
    """The batch-invariant forward and a fixed-order backward. `pages`: PackedPages, or a shared-prefix
    packing's kernels.shared_attention.SharedPages (a table, tiles and a backward each)."""

    @staticmethod
    def forward(ctx, q, k, v, pages):
        k, v = k.contiguous(), v.contiguous()
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # [N, Hq]
        out = paged_attention(q, k, v, pages.table, 1, pages.tiles, lse=lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pages = pages
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*ctx.pages.backward(*ctx.saved_tensors, grad), None)


def exact_packed_attention(q, k, v, pages) -> torch.Tensor:
    """Causal attention within each packed sequence (`pages`: PackedPages; or SharedPages, whose
    responses also see their prompt), batch-invariant and equal to the engine's for the same tokens;
    differentiable, its backward repeating to the bit."""
    return _PackedAttention.apply(q, k, v, pages)
