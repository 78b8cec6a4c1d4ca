"""Causal attention whose result for a query depends on its own position and keys only: not on the
other queries of its tile, the batch, or whether it runs in the trainer's packed forward, a prefill
or a decode step.

The keys 0..p of a query at position p are read in blocks of BLOCK_N from position 0; each block's
softmax state (max, sum, weighted values) is its own, from scratch, and the blocks merge in order. A tile holds every query head of one KV head for a few consecutive
positions of one sequence (one position in a decode step: a tile of 16 rows there, 64 elsewhere).
Every sum over keys is a matmul (the weighted values, and the row sums as the weights times ones),
whose order does not follow the tile's rows as a reduction's would, so a row's bits do not depend on
the tile it sits in. Blocks past a query's position are masked whole and leave its state unchanged,
so a tile's longest query sets the loop without touching the others.

Two forms of the same sums: one program per tile loops over the blocks (prefill, training); or, for
few queries (decode), one program per block writes its state and a second kernel merges them in
order: a decode step's query reads its keys in as many programs as it has blocks. K/V are read through a page table: the engine's pages, or the trainer's packed rows as pages
of one token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from hybridflow.kernels.launch import OPTIONS, UPCAST, dot, interpreted

# Tile rows (query positions x heads of a group) and key block: fixed for a run, the bits follow the
# block. (Before, a state ran online over chunks of 512 keys, merged in order: a decode step's
# one-sequence attention was then one program a KV head, 8 us a layer on an H100.) The interpreter's
# are small for tiny models
BLOCK_M, BLOCK_N = (16, 16) if interpreted() else (64, 64)
WARPS = 1 if interpreted() else 4
# A split's block states: a long table's many blocks past this are looped instead (the same bits)
SPLIT_STATE_BYTES = 64 << 20


@triton.jit
def _load_queries(q_ptr, tile, kv_head, tile_seq_ptr, tile_pos_ptr, tile_row_ptr, tile_count_ptr,
                  stride_qn, stride_qh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):  # fmt: skip
    """A tile's queries [BLOCK_M, HEAD_PAD] (row r: position first + r // GROUP_PAD, head
    kv_head * GROUP + r % GROUP_PAD) with their positions, validity, rows and heads."""
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_pos_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    count = tl.load(tile_count_ptr + tile)
    r = tl.arange(0, BLOCK_M)
    query = r // GROUP_PAD
    group_head = r % GROUP_PAD
    valid = (query < count) & (group_head < GROUP)
    rows = (row0 + query).to(tl.int64)
    heads = kv_head * GROUP + group_head
    d = tl.arange(0, HEAD_PAD)
    at = rows[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + at, mask=valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    return q, first + query, valid, rows, heads, seq, first + count - 1


@triton.jit
def _block_state(q, positions, last, start, k_ptr, v_ptr, table_row, page_size, kv_head,
                 stride_kn, stride_kh, scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Softmax state of keys [start, start + BLOCK_N) for each row, from scratch: max m [BLOCK_M]
    (log2 units, -inf where every key is masked), sum denom, weighted values acc [BLOCK_M, HEAD_PAD]."""
    d = tl.arange(0, HEAD_PAD)
    j = start + tl.arange(0, BLOCK_N)
    present = j <= last
    page = tl.load(table_row + j // page_size, mask=present, other=0).to(tl.int64)
    slot = page * page_size + j % page_size
    at = slot[:, None] * stride_kn + kv_head * stride_kh + d[None, :]
    kv_mask = present[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + at, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_PAD]
    v = tl.load(v_ptr + at, mask=kv_mask, other=0.0)
    s = dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), PRECISION, UPCAST) * scale
    s = tl.where(j[None, :] <= positions[:, None], s, float("-inf"))
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a row that sees none of these keys: all weights 0
    weights = tl.exp2(s - m_safe[:, None]).to(v.dtype)  # [BLOCK_M, BLOCK_N]
    # the row sums of the weights that multiply the values, as a matmul: a fixed order (every
    # column the same sum; tl.sum's order would follow the tile's layout)
    ones = tl.full([BLOCK_N, 16], 1.0, k_ptr.dtype.element_ty)  # (16: a matmul's narrowest tile)
    denom = tl.max(dot(weights, ones, tl.zeros([BLOCK_M, 16], tl.float32), PRECISION, UPCAST), 1)
    acc = dot(weights, v, tl.zeros([BLOCK_M, HEAD_PAD], tl.float32), PRECISION, UPCAST)
    return m, denom, acc


@triton.jit
def _merge(m, denom, acc, m_c, denom_c, acc_c):
    """The running state and a later block's, merged (a block a row sees nothing of leaves its state
    as it is, to the bit: so a tile's longest query sets the loop without touching the others)."""
    m_new = tl.maximum(m, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a = tl.exp2(m - m_safe)
    b = tl.exp2(m_c - m_safe)
    return m_new, denom * a + denom_c * b, acc * a[:, None] + acc_c * b[:, None]


@triton.jit
def _store(o_ptr, rows, heads, valid, denom, acc, stride_on, stride_oh,
           HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):  # fmt: skip
    d = tl.arange(0, HEAD_PAD)
    out = acc / denom[:, None]
    at = rows[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + at, out.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=["page_size", "stride_table"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, table_ptr, page_size,
                      tile_seq_ptr, tile_pos_ptr, tile_row_ptr, tile_count_ptr,
                      stride_qn, stride_qh, stride_kn, stride_kh, stride_on, stride_oh, stride_table, scale,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_PAD: tl.constexpr, PRECISION: tl.constexpr, STORE_LSE: tl.constexpr):  # fmt: skip
    """One tile, every block in order; STORE_LSE: each row's log2-sum-exp2 into lse [N, Hq] too (the
    backward's)."""
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    q, positions, valid, rows, heads, seq, last = _load_queries(
        q_ptr, tile, kv_head, tile_seq_ptr, tile_pos_ptr, tile_row_ptr, tile_count_ptr,
        stride_qn, stride_qh, GROUP, GROUP_PAD, BLOCK_M, HEAD_DIM, HEAD_PAD)  # fmt: skip
    table_row = table_ptr + seq.to(tl.int64) * stride_table
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        m_c, denom_c, acc_c = _block_state(
            q, positions, last, start, k_ptr, v_ptr, table_row, page_size, kv_head,
            stride_kn, stride_kh, scale, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PRECISION)  # fmt: skip
        m, denom, acc = _merge(m, denom, acc, m_c, denom_c, acc_c)
    _store(o_ptr, rows, heads, valid, denom, acc, stride_on, stride_oh, HEAD_DIM, HEAD_PAD)
    if STORE_LSE:
        tl.store(lse_ptr + rows * (tl.num_programs(1) * GROUP) + heads, m + tl.log2(denom), mask=valid)


@triton.jit(do_not_specialize=["page_size", "stride_table", "blocks"])
def _block_kernel(q_ptr, k_ptr, v_ptr, state_ptr, acc_ptr, table_ptr, page_size,
                  tile_seq_ptr, tile_pos_ptr, tile_row_ptr, tile_count_ptr,
                  stride_qn, stride_qh, stride_kn, stride_kh, stride_table, scale, blocks,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_PAD: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One tile's key block program_id(2): its state into state [tiles, KV heads, blocks, 2, BLOCK_M]
    and acc [tiles, KV heads, blocks, BLOCK_M, HEAD_PAD] (blocks past the tile's last query: nothing)."""
    tile, kv_head, block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q, positions, valid, rows, heads, seq, last = _load_queries(
        q_ptr, tile, kv_head, tile_seq_ptr, tile_pos_ptr, tile_row_ptr, tile_count_ptr,
        stride_qn, stride_qh, GROUP, GROUP_PAD, BLOCK_M, HEAD_DIM, HEAD_PAD)  # fmt: skip
    if block * BLOCK_N <= last:
        table_row = table_ptr + seq.to(tl.int64) * stride_table
        m_c, denom_c, acc_c = _block_state(
            q, positions, last, block * BLOCK_N, k_ptr, v_ptr, table_row, page_size, kv_head,
            stride_kn, stride_kh, scale, BLOCK_M, BLOCK_N, HEAD_DIM, HEAD_PAD, PRECISION)  # fmt: skip
        at = (tile.to(tl.int64) * tl.num_programs(1) + kv_head) * blocks + block
        r = tl.arange(0, BLOCK_M)
        tl.store(state_ptr + at * 2 * BLOCK_M + r, m_c)
        tl.store(state_ptr + at * 2 * BLOCK_M + BLOCK_M + r, denom_c)
        d = tl.arange(0, HEAD_PAD)
        tl.store(acc_ptr + at * BLOCK_M * HEAD_PAD + r[:, None] * HEAD_PAD + d[None, :], acc_c)


@triton.jit(do_not_specialize=["blocks"])
def _merge_kernel(state_ptr, acc_ptr, o_ptr, tile_seq_ptr, tile_pos_ptr, tile_row_ptr, tile_count_ptr,
                  stride_on, stride_oh, blocks,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):  # fmt: skip
    """A tile's block states merged in order, as the looping kernel merges them."""
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    first = tl.load(tile_pos_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    count = tl.load(tile_count_ptr + tile)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    query = r // GROUP_PAD
    valid = (query < count) & (r % GROUP_PAD < GROUP)
    rows = (row0 + query).to(tl.int64)
    heads = kv_head * GROUP + r % GROUP_PAD
    last = first + count - 1
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    base = (tile.to(tl.int64) * tl.num_programs(1) + kv_head) * blocks
    for block in range(0, tl.cdiv(last + 1, BLOCK_N)):
        at = base + block
        m_c = tl.load(state_ptr + at * 2 * BLOCK_M + r)
        denom_c = tl.load(state_ptr + at * 2 * BLOCK_M + BLOCK_M + r)
        acc_c = tl.load(acc_ptr + at * BLOCK_M * HEAD_PAD + r[:, None] * HEAD_PAD + d[None, :])
        m, denom, acc = _merge(m, denom, acc, m_c, denom_c, acc_c)
    _store(o_ptr, rows, heads, valid, denom, acc, stride_on, stride_oh, HEAD_DIM, HEAD_PAD)


@dataclass
class Tiles:
    """Query tiles: each `count` consecutive positions from `first` of table row `seq`, whose queries
    are the rows from `row` of q. [T] int32 each, on the device."""

    seq: torch.Tensor
    first: torch.Tensor
    row: torch.Tensor
    count: torch.Tensor
    positions: int  # the most a tile holds (its rows: these times the group's heads, padded)

    @staticmethod
    def of_runs(firsts, rows, counts, group: int, device) -> Tiles:
        """Tiles over runs of queries: run i is counts[i] positions from firsts[i] (rows from rows[i])."""
        positions = max(1, BLOCK_M // _group_pad(group))
        return Tiles(*split_runs(firsts, rows, counts, positions, device), positions)

    @staticmethod
    def of_decode(context_lens: torch.Tensor) -> Tiles:
        """One tile per sequence of a decode step: its query at position context - 1 (none where the
        context is 0: a padded row). Device ops only (inside a decode graph)."""
        rows = torch.arange(context_lens.shape[0], dtype=torch.int32, device=context_lens.device)
        return Tiles(rows, context_lens.int() - 1, rows, (context_lens > 0).int(), 1)


def split_runs(firsts, rows, counts, size: int, device) -> list[torch.Tensor]:
    """Runs (counts[i] positions from firsts[i], rows from rows[i]) cut into blocks of `size`
    positions: each block's (run, first position, first row, positions) [blocks] int32 on `device`."""
    firsts, rows, counts = (np.asarray(a, dtype=np.int64) for a in (firsts, rows, counts))
    n = -(-counts // size)  # blocks per run
    run = np.repeat(np.arange(len(counts)), n)
    within = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)  # block index inside its run
    offset = within * size
    count = np.minimum(size, counts[run] - offset)
    parts = (run, firsts[run] + offset, rows[run] + offset, count)
    return [torch.from_numpy(p.astype(np.int32)).to(device, non_blocking=True) for p in parts]


def _group_pad(group: int) -> int:
    """The heads of a group padded to a power of two (a tile's rows hold whole groups)."""
    return triton.next_power_of_2(group)


def _tile_rows(group: int, positions: int) -> int:
    """A tile's rows: its positions' padded groups, at least 16 (a matmul's narrowest tile)."""
    return max(16, _group_pad(group) * positions)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    page_size: int,
    tiles: Tiles,
    *,
    split: bool = False,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, Hq, D]; k/v [S, Hkv, D] (slot s of key position j of table row b: table[b, j // page_size]
    * page_size + j % page_size); table [B, P] int32 -> [N, Hq, D] in q's dtype (rows no tile covers
    are left as they are). split: one program per key block and a merge (few tiles): the same bits.
    lse: [N, Hq] float32, written with each row's log2-sum-exp2 of the scaled scores (not with split)."""
    n, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    group_pad, block_m = _group_pad(group), _tile_rows(group, tiles.positions)
    head_pad = max(16, triton.next_power_of_2(dim))
    out = torch.empty_like(q)
    tile_count = tiles.seq.shape[0]
    if tile_count == 0:
        return out
    scale = dim**-0.5 * 1.4426950408889634  # log2(e): the kernels exponentiate in base 2
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    table = table if table.stride(-1) == 1 else table.contiguous()
    meta = dict(GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=BLOCK_N, HEAD_DIM=dim,
                HEAD_PAD=head_pad)  # fmt: skip
    tile_args = (tiles.seq, tiles.first, tiles.row, tiles.count)
    blocks = -(-table.shape[1] * page_size // BLOCK_N)  # enough for the longest context the table holds
    split = split and tile_count * kv_heads * blocks * block_m * (head_pad + 2) * 4 <= SPLIT_STATE_BYTES
    if not split:
        _attention_kernel[(tile_count, kv_heads)](
            q, k, v, out, out if lse is None else lse, table, page_size, *tile_args,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1), table.stride(0),
            scale, PRECISION=precision, STORE_LSE=lse is not None, num_warps=WARPS,
            **meta, **OPTIONS,
        )  # fmt: skip
        return out
    if lse is not None:
        raise ValueError("paged_attention: lse is written by the looping form only (split=False)")
    state = torch.empty(tile_count, kv_heads, blocks, 2, block_m, dtype=torch.float32, device=q.device)
    acc = torch.empty(tile_count, kv_heads, blocks, block_m, head_pad, dtype=torch.float32, device=q.device)
    _block_kernel[(tile_count, kv_heads, blocks)](
        q, k, v, state, acc, table, page_size, *tile_args,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0), scale, blocks,
        PRECISION=precision, num_warps=WARPS, **meta, **OPTIONS,
    )  # fmt: skip
    _merge_kernel[(tile_count, kv_heads)](
        state, acc, out, *tile_args, out.stride(0), out.stride(1), blocks,
        num_warps=WARPS, **meta, **OPTIONS,
    )  # fmt: skip
    return out
