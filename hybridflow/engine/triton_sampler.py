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


@triton.jit(do_not_specialize=["span"])
def _sample_slice_kernel(
    logits_ptr,  # [B, V]
    keys_ptr,  # [B] int64 noise keys (31-bit values)
    part_ptr,  # [B, S, 7] float32: max and sum of the scaled and unscaled rows; winner's score, w, raw
    part_idx_ptr,  # [B, S] int32: the slice's winner
    stride_b,
    vocab,
    span,  # entries per slice, a multiple of BLOCK
    inv_temperature,
    inv_t_ptr,  # [1] float32: the inverse temperature, read from the device when T_PTR
    GREEDY: tl.constexpr,
    T_PTR: tl.constexpr,
    UNSCALED: tl.constexpr,  # temperature 1: the scaled row is the unscaled one
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    if T_PTR:
        inv_temperature = tl.load(inv_t_ptr)
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
            bits = _mix31(key ^ j.to(tl.uint32)) >> 8  # sampler.NOISE_BITS: u inside (0, 1), noise finite
            u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
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


@triton.jit(do_not_specialize=["splits", "batch", "stride_run", "n_stops"])
def _merge_kernel(
    part_ptr,  # [B, S, 7]
    part_idx_ptr,  # [B, S]
    out_token_ptr,  # [B] int64
    out_lp_ptr,  # [2, B] float32: sampling log-prob, unscaled log-prob
    splits,
    batch,
    step_ptr,  # FINISH: [1] int64, one past the step being drawn (prepare_step counted it)
    run_ptr,  # FINISH: [steps, 4, R] float64 record of the run: token, log-prob, unscaled, stop
    stride_run,  # FINISH: elements per step of the record
    ids_ptr,  # FINISH: [R] int64 the next step's input tokens
    pos_ptr,  # FINISH: [R] int64 positions, advanced for rows still within their limit
    limit_ptr,  # FINISH: [R] int64
    stops_ptr,  # FINISH: [n_stops] int64 stop token ids, padded with -1
    n_stops,
    GREEDY: tl.constexpr,
    SPLITS: tl.constexpr,  # a power of two >= splits (MAX_SPLITS: one compiled kernel for all)
    FINISH: tl.constexpr,  # record the draw and advance the rows (a decode step's last kernel)
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
    if GREEDY:
        sampled = unscaled
    else:
        sampled = w_win - lse_w
    if FINISH:
        k = tl.load(step_ptr) - 1
        hits = 0
        for start in range(0, n_stops, 64):
            stops = tl.load(
                stops_ptr + start + tl.arange(0, 64), mask=start + tl.arange(0, 64) < n_stops, other=-1
            )
            hits += tl.sum((stops == token.to(tl.int64)).to(tl.int32), 0)
        stop = hits > 0
        rec = run_ptr + k * stride_run + row
        tl.store(rec, token.to(tl.float64))
        tl.store(rec + batch, sampled.to(tl.float64))
        tl.store(rec + 2 * batch, unscaled.to(tl.float64))
        tl.store(rec + 3 * batch, stop.to(tl.float64))
        tl.store(ids_ptr + row, token.to(tl.int64))
        limit = tl.load(limit_ptr + row)
        tl.store(pos_ptr + row, tl.load(pos_ptr + row) + (limit > k).to(tl.int64))
    else:
        tl.store(out_token_ptr + row, token.to(tl.int64))
        tl.store(out_lp_ptr + row, sampled)
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
    splits, span = _splits(b, vocab, block, programs_target)
    device = logits.device
    part = torch.empty(b, splits, 7, dtype=torch.float32, device=device)
    part_idx = torch.empty(b, splits, dtype=torch.int32, device=device)
    tokens = torch.empty(b, dtype=torch.int64, device=device)
    lps = torch.empty(2, b, dtype=torch.float32, device=device)
    greedy = temperature == 0
    inv_t = 1.0 if greedy else 1.0 / temperature
    _sample_slice_kernel[(b, splits)](
        logits, keys, part, part_idx, logits.stride(0), vocab, span, inv_t, part,
        GREEDY=greedy, T_PTR=False, UNSCALED=inv_t == 1.0, BLOCK=block,
    )  # fmt: skip
    _merge_kernel[(b,)](
        part, part_idx, tokens, lps, splits, b, *([part] * 7), 0, GREEDY=greedy,
        SPLITS=MAX_SPLITS, FINISH=False,
    )  # fmt: skip
    return tokens, lps[0], lps[1]


def _splits(b: int, vocab: int, block: int, programs_target: int) -> tuple[int, int]:
    blocks = -(-vocab // block)
    splits = max(1, min(MAX_SPLITS, blocks, -(-programs_target // b)))
    span = -(-blocks // splits) * block
    return -(-vocab // span), span  # no empty slice


def sample_step_triton(
    logits: torch.Tensor,
    mode: str,
    inv_temperature: torch.Tensor,
    keys: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    block: int = BLOCK,
    programs_target: int = PROGRAMS_TARGET,
) -> None:
    """A decode step's draw, recorded and fed back on the device (nothing returns to the host):
    logits [R, V]; mode 'greedy', 'unit' (temperature 1) or 'scaled' (inv_temperature [1] float32,
    read on the device); keys [R]. `state`: step [1] (one past this step), run [steps, 4, R]
    float64, ids, pos, limit [R], stops [S] (stop ids, padded with -1)."""
    b, vocab = logits.shape
    splits, span = _splits(b, vocab, block, programs_target)
    part = torch.empty(b, splits, 7, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(b, splits, dtype=torch.int32, device=logits.device)
    greedy = mode == "greedy"
    run = state["run"]
    _sample_slice_kernel[(b, splits)](
        logits, keys, part, part_idx, logits.stride(0), vocab, span, 1.0, inv_temperature,
        GREEDY=greedy, T_PTR=mode == "scaled", UNSCALED=mode != "scaled", BLOCK=block,
    )  # fmt: skip
    _merge_kernel[(b,)](
        part, part_idx, part, part, splits, b, state["step"], run, run.stride(0), state["ids"],
        state["pos"], state["limit"], state["stops"], state["stops"].numel(), GREEDY=greedy,
        SPLITS=MAX_SPLITS, FINISH=True,
    )  # fmt: skip
