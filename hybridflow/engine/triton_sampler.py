"""Sampler in Triton for plain temperature sampling (no top-k / top-p) and greedy, in one read of the
logits: each program sweeps a slice of one row's vocabulary, keeping the running log-sum-exp of the
scaled and unscaled logits and the Gumbel-max winner; a second kernel merges a row's slices. No
[B, V] temporaries are written. Same noise as `sampler.sample`.

A row split in slices keeps the GPU busy at small batches (one program per row would scan 152k
entries serially); the noise hash runs in 32-bit integers (the low 31 bits of a product depend only
on the operands' low 31 bits, so it equals the reference's int64 hash)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
PROGRAMS_TARGET = 1024  # enough programs to fill the GPU's SMs a few times over
MAX_SPLITS = 64


@triton.jit
def _mix31(x):
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0x7FFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0x7FFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _sample_slice_kernel(
    logits_ptr,  # [B, V]
    keys_ptr,  # [B] int64 noise keys (31-bit values)
    part_ptr,  # [B, S, 7] float32: max and sum of the scaled and unscaled rows; winner's score, w, raw
    part_idx_ptr,  # [B, S] int32: the slice's winner
    stride_b,
    vocab,
    span,  # entries per slice, a multiple of BLOCK
    inv_temperature,
    GREEDY: tl.constexpr,
    UNSCALED: tl.constexpr,  # temperature 1: the scaled row is the unscaled one
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    offs = tl.arange(0, BLOCK)
    m_w = float("-inf")
    s_w = 0.0
    m_r = float("-inf")
    s_r = 0.0
    best = float("-inf")
    best_idx = 0
    best_w = 0.0
    best_r = 0.0
    lo = split * span
    hi = tl.minimum(lo + span, vocab)
    for start in range(lo, hi, BLOCK):
        j = start + offs
        valid = j < hi
        raw = tl.load(logits_ptr + row * stride_b + j, mask=valid, other=float("-inf")).to(tl.float32)
        if UNSCALED:
            w = raw
        else:
            w = raw * inv_temperature
        if GREEDY:
            score = raw
        else:
            bits = _mix31(key ^ j.to(tl.uint32)) >> 7
            u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = tl.where(valid, w - tl.log(-tl.log(u)), float("-inf"))
        # running log-sum-exp of both distributions
        m_new = tl.maximum(m_r, tl.max(raw, 0))
        s_r = s_r * tl.exp(m_r - m_new) + tl.sum(tl.exp(raw - m_new), 0)
        m_r = m_new
        if not UNSCALED:
            m_new = tl.maximum(m_w, tl.max(w, 0))
            s_w = s_w * tl.exp(m_w - m_new) + tl.sum(tl.exp(w - m_new), 0)
            m_w = m_new
        # Gumbel-max (or argmax) winner; strict > keeps the first index on ties, like torch.argmax
        chunk_best = tl.max(score, 0)
        chunk_idx = tl.argmax(score, 0)
        is_idx = offs == chunk_idx
        if chunk_best > best:
            best = chunk_best
            best_idx = start + chunk_idx
            best_w = tl.sum(tl.where(is_idx, w, 0.0), 0)
            best_r = tl.sum(tl.where(is_idx, raw, 0.0), 0)
    if UNSCALED:
        m_w = m_r
        s_w = s_r
    out = part_ptr + (row * splits + split) * 7
    tl.store(out + 0, m_w)
    tl.store(out + 1, s_w)
    tl.store(out + 2, m_r)
    tl.store(out + 3, s_r)
    tl.store(out + 4, best)
    tl.store(out + 5, best_w)
    tl.store(out + 6, best_r)
    tl.store(part_idx_ptr + row * splits + split, best_idx.to(tl.int32))


@triton.jit
def _merge_kernel(
    part_ptr,  # [B, S, 7]
    part_idx_ptr,  # [B, S]
    out_token_ptr,  # [B] int64
    out_lp_ptr,  # [2, B] float32: sampling log-prob, unscaled log-prob
    splits,
    batch,
    GREEDY: tl.constexpr,
    SPLITS: tl.constexpr,  # power of two >= splits
):
    row = tl.program_id(0)
    s = tl.arange(0, SPLITS)
    present = s < splits
    base = part_ptr + (row * splits + s) * 7
    m_w = tl.load(base + 0, mask=present, other=float("-inf"))
    s_w = tl.load(base + 1, mask=present, other=0.0)
    m_r = tl.load(base + 2, mask=present, other=float("-inf"))
    s_r = tl.load(base + 3, mask=present, other=0.0)
    score = tl.load(base + 4, mask=present, other=float("-inf"))
    best_w = tl.load(base + 5, mask=present, other=0.0)
    best_r = tl.load(base + 6, mask=present, other=0.0)
    idx = tl.load(part_idx_ptr + row * splits + s, mask=present, other=0)
    win = tl.argmax(score, 0)  # the first slice on ties: the lowest index, like torch.argmax
    is_win = s == win
    token = tl.sum(tl.where(is_win, idx, 0), 0)
    w_win = tl.sum(tl.where(is_win, best_w, 0.0), 0)
    r_win = tl.sum(tl.where(is_win, best_r, 0.0), 0)
    mw = tl.max(m_w, 0)
    mr = tl.max(m_r, 0)
    lse_w = mw + tl.log(tl.sum(tl.where(present, s_w * tl.exp(m_w - mw), 0.0), 0))
    lse_r = mr + tl.log(tl.sum(tl.where(present, s_r * tl.exp(m_r - mr), 0.0), 0))
    unscaled = r_win - lse_r
    tl.store(out_token_ptr + row, token.to(tl.int64))
    if GREEDY:
        tl.store(out_lp_ptr + row, unscaled)
    else:
        tl.store(out_lp_ptr + row, w_win - lse_w)
    tl.store(out_lp_ptr + batch + row, unscaled)


def sample_triton(
    logits: torch.Tensor,
    temperature: float,
    keys: torch.Tensor,
    *,
    block: int = BLOCK,
    programs_target: int = PROGRAMS_TARGET,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], keys [B] int64 -> token [B] int64, sampling log-prob [B], unscaled log-prob [B]."""
    b, vocab = logits.shape
    blocks = -(-vocab // block)
    splits = max(1, min(MAX_SPLITS, blocks, -(-programs_target // b)))
    span = -(-blocks // splits) * block
    splits = -(-vocab // span)  # no empty slice
    device = logits.device
    part = torch.empty(b, splits, 7, dtype=torch.float32, device=device)
    part_idx = torch.empty(b, splits, dtype=torch.int32, device=device)
    tokens = torch.empty(b, dtype=torch.int64, device=device)
    lps = torch.empty(2, b, dtype=torch.float32, device=device)
    greedy = temperature == 0
    inv_t = 1.0 if greedy else 1.0 / temperature
    _sample_slice_kernel[(b, splits)](
        logits, keys, part, part_idx, logits.stride(0), vocab, span, inv_t,
        GREEDY=greedy, UNSCALED=inv_t == 1.0, BLOCK=block,
    )  # fmt: skip
    _merge_kernel[(b,)](
        part, part_idx, tokens, lps, splits, b, GREEDY=greedy,
        SPLITS=triton.next_power_of_2(splits),
    )  # fmt: skip
    return tokens, lps[0], lps[1]
