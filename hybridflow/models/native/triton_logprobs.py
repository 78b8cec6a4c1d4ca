"""The LM head's per-chunk softmax work in Triton (CUDA): one read of a chunk's [c, V] logits for
log p(target), entropy and log-sum-exp in the forward, and one read and one write for the logits'
gradient in the backward (from the forward's log-sum-exp). The compiled PyTorch version read the
logits three to four times each way.

A row's softmax sums run over fixed slices of the vocabulary, each from scratch in its own program,
then merge in slice order: a decode step's few rows fill the processors (one program a row looped
over a 152k vocabulary for ~60 us), and a row's bits depend on the vocabulary alone, the same for the
engine's record and the trainer's chunks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.kernels.launch import OPTIONS

BLOCK, SLICE_BLOCKS = 2048, 4  # a vocabulary slice: SLICE_BLOCKS blocks of BLOCK entries


@triton.jit
def _merge_state(m, s, t, m_c, s_c, t_c):
    """A running softmax state (max m, sum of exp(x - m) s, sum of x * exp(x - m) t) and a later
    slice's, merged."""
    m_new = tl.maximum(m, m_c)
    a = tl.exp(m - m_new)
    b = tl.exp(m_c - m_new)
    return m_new, s * a + s_c * b, t * a + t_c * b


@triton.jit(do_not_specialize=["slices"])
def _slice_stats_kernel(
    logits_ptr,  # [c, V] in the matmul's dtype
    part_ptr,  # [c, slices, 3] float32 out: each slice's (m, s, t), from scratch
    stride,
    vocab,
    scale,
    slices,
    BLOCK: tl.constexpr,
    SLICE_BLOCKS: tl.constexpr,
):
    row, piece = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = logits_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    m = float("-inf")
    s = 0.0  # sum of exp(x - m)
    t = 0.0  # sum of x * exp(x - m)
    for block in range(0, SLICE_BLOCKS):
        j = (piece * SLICE_BLOCKS + block) * BLOCK + offs
        x = tl.load(base + j, mask=j < vocab, other=float("-inf")).to(tl.float32) * scale
        m_new = tl.maximum(m, tl.max(x, 0))
        e = tl.exp(x - m_new)  # (0 past the vocabulary; a block wholly past it leaves the state as is)
        x_e = tl.where(j < vocab, x * e, 0.0)
        rescale = tl.exp(m - m_new)
        s = s * rescale + tl.sum(e, 0)
        t = t * rescale + tl.sum(x_e, 0)
        m = m_new
    at = part_ptr + (row * slices + piece) * 3
    tl.store(at, m)
    tl.store(at + 1, s)
    tl.store(at + 2, t)


@triton.jit(do_not_specialize=["slices"])
def _stats_kernel(
    logits_ptr,  # [c, V] in the matmul's dtype
    targets_ptr,  # [c] int64
    part_ptr,  # [c, slices, 3] float32: _slice_stats_kernel's
    logp_ptr,  # [c] float32 out
    entropy_ptr,  # [c] float32 out
    lse_ptr,  # [c] float32 out: log-sum-exp of the scaled row
    stride,
    scale,
    slices,
):
    """A row's slices merged in order (from the empty state: the first merge is the first slice's
    state itself), then its log p(target), entropy and log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    at = part_ptr + row * slices * 3
    m = float("-inf")
    s = 0.0
    t = 0.0
    for _ in range(0, slices):
        m, s, t = _merge_state(m, s, t, tl.load(at), tl.load(at + 1), tl.load(at + 2))
        at += 3
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row)
    chosen = tl.load(logits_ptr + row * stride + target).to(tl.float32) * scale
    tl.store(logp_ptr + row, chosen - lse)
    tl.store(entropy_ptr + row, lse - t / s)  # lse - sum p * x
    tl.store(lse_ptr + row, lse)


@triton.jit
def _grad_kernel(
    logits_ptr,  # [c, V]: read, then overwritten by the gradient
    targets_ptr,  # [c] int64
    grad_ptr,  # [c] float32: d loss / d log p(target)
    lse_ptr,  # [c] float32
    stride,
    vocab,
    scale,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = j < vocab
    base = logits_ptr + row * stride
    x = tl.load(base + j, mask=valid, other=0.0).to(tl.float32) * scale
    p = tl.exp(x - tl.load(lse_ptr + row))
    onehot = (j == tl.load(targets_ptr + row)).to(tl.float32)
    d = (onehot - p) * (tl.load(grad_ptr + row) * scale)
    tl.store(base + j, d.to(logits_ptr.dtype.element_ty), mask=valid)


def chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [c, V] (rows contiguous), targets [c] -> log p(target), entropy, log-sum-exp [c] each,
    float32, of softmax(logits * scale)."""
    c, vocab = logits.shape
    out = torch.empty(3, c, dtype=torch.float32, device=logits.device)
    if c:
        slices = triton.cdiv(vocab, BLOCK * SLICE_BLOCKS)
        part = torch.empty(c, slices, 3, dtype=torch.float32, device=logits.device)
        _slice_stats_kernel[(c, slices)](
            logits, part, logits.stride(0), vocab, scale, slices, BLOCK=BLOCK, SLICE_BLOCKS=SLICE_BLOCKS,
            **OPTIONS,
        )  # fmt: skip
        _stats_kernel[(c,)](
            logits, targets, part, out[0], out[1], out[2], logits.stride(0), scale, slices, **OPTIONS
        )
    return out[0], out[1], out[2]


def chunk_grad_(
    logits: torch.Tensor, targets: torch.Tensor, grad_logp: torch.Tensor, lse: torch.Tensor, scale: float
) -> torch.Tensor:
    """In place: logits [c, V] -> d loss / d logits = (onehot(target) - softmax) * grad * scale, in the
    logits' dtype (the logits themselves are not needed afterwards)."""
    c, vocab = logits.shape
    if c:
        _grad_kernel[(c, triton.cdiv(vocab, BLOCK))](
            logits, targets, grad_logp, lse, logits.stride(0), vocab, scale, BLOCK=BLOCK
        )
    return logits
