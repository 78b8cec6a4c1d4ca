"""One-pass sampler in Triton for plain temperature sampling (no top-k / top-p) and greedy: per row,
a single sweep over the vocabulary keeps the running log-sum-exp of the scaled and unscaled logits
and the Gumbel-max winner, so no [B, V] temporaries are written. Same noise as `sampler.sample`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix31(x):
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0x7FFFFFFF
    x = (((x >> 16) ^ x) * 0x45D9F3B) & 0x7FFFFFFF
    return (x >> 16) ^ x


@triton.jit
def _sample_kernel(
    logits_ptr,  # [B, V]
    keys_ptr,  # [B] int64 noise keys
    out_token_ptr,  # [B] int64
    out_lp_ptr,  # [2, B] float32: sampling log-prob, unscaled log-prob
    stride_b,
    vocab,
    batch,
    inv_temperature,
    GREEDY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    key = tl.load(keys_ptr + row)
    offs = tl.arange(0, BLOCK)
    m_w = float("-inf")
    s_w = 0.0
    m_r = float("-inf")
    s_r = 0.0
    best = float("-inf")
    best_idx = 0
    best_w = 0.0
    best_r = 0.0
    for start in range(0, vocab, BLOCK):
        j = start + offs
        valid = j < vocab
        raw = tl.load(logits_ptr + row * stride_b + j, mask=valid, other=float("-inf")).to(tl.float32)
        w = raw * inv_temperature
        if GREEDY:
            score = raw
        else:
            bits = _mix31(key ^ j.to(tl.int64)) >> 7
            u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            score = w - tl.log(-tl.log(u))
        score = tl.where(valid, score, float("-inf"))
        # running log-sum-exp of both distributions
        m_new = tl.maximum(m_w, tl.max(w, 0))
        s_w = s_w * tl.exp(m_w - m_new) + tl.sum(tl.exp(w - m_new), 0)
        m_w = m_new
        m_new = tl.maximum(m_r, tl.max(raw, 0))
        s_r = s_r * tl.exp(m_r - m_new) + tl.sum(tl.exp(raw - m_new), 0)
        m_r = m_new
        # Gumbel-max (or argmax) winner; strict > keeps the first index on ties, like torch.argmax
        chunk_best = tl.max(score, 0)
        chunk_idx = tl.argmax(score, 0)
        is_idx = offs == chunk_idx
        if chunk_best > best:
            best = chunk_best
            best_idx = start + chunk_idx
            best_w = tl.sum(tl.where(is_idx, w, 0.0), 0)
            best_r = tl.sum(tl.where(is_idx, raw, 0.0), 0)
    unscaled = best_r - m_r - tl.log(s_r)
    tl.store(out_token_ptr + row, best_idx.to(tl.int64))
    if GREEDY:
        tl.store(out_lp_ptr + row, unscaled)
    else:
        tl.store(out_lp_ptr + row, best_w - m_w - tl.log(s_w))
    tl.store(out_lp_ptr + batch + row, unscaled)


def sample_triton(
    logits: torch.Tensor, temperature: float, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [B, V], keys [B] int64 -> token [B] int64, sampling log-prob [B], unscaled log-prob [B]."""
    b, vocab = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    lps = torch.empty(2, b, dtype=torch.float32, device=logits.device)
    greedy = temperature == 0
    _sample_kernel[(b,)](
        logits, keys, tokens, lps, logits.stride(0), vocab, b, 1.0 if greedy else 1.0 / temperature,
        GREEDY=greedy, BLOCK=min(4096, triton.next_power_of_2(vocab)),
    )  # fmt: skip
    return tokens, lps[0], lps[1]
