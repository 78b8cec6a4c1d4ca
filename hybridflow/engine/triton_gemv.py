"""The decode step's matmuls at small batch (up to 16 rows), with the layer's
neighbouring work in their prologue: at batch 1-16 a step is bound by launches and weight reads, and
cuBLAS's kernels for one row read the small projections well below bandwidth (split-K adds a
reduction launch). Here each program owns BLOCK_N output columns for all rows and streams its slice of
the weight once; the rows are a 16-row tile of a tensor-core dot, so one row costs what 16 do.

The prologue makes the matmul's input from what the previous kernel left, rounding where the
trainer's layer rounds (as `triton_layer.rms_norm` and `silu_mul` do):
- NORM: x (the residual stream; the embedding rows of `ids` with EMBED; plus `residual` with HAS_RES,
  rounded to x's dtype) through RMSNorm with `norm_weight`, cast to the compute dtype. Each program
  computes the row's statistic itself (a row is ~1-8k numbers); the programs of the first column block
  write the new residual stream to `x_out` (another buffer than x: the others still read x).
- SWIGLU: silu(gate) * up from the gate/up projection's output.
and the bias in the epilogue. So a layer is six launches (norm+QKV, rotary + K/V store, attention,
the output matmul, residual+norm+gate/up, SwiGLU+down) where it was nine or ten."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.kernels.launch import UPCAST, dot

ROWS = 16  # the most rows: one tile of the dot (engine/fused_decode.SMALL_ROWS sends them here)

PLAIN, NORM, SWIGLU = 0, 1, 2


@triton.jit
def _round(x, X_BF16: tl.constexpr):
    """x (float32) rounded to the residual dtype, kept in float32."""
    if X_BF16:
        return x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _residual(x_ptr, res_ptr, ids_ptr, embed_ptr, rm, k, M, K, stride_x,
              EMBED: tl.constexpr, HAS_RES: tl.constexpr, X_BF16: tl.constexpr):  # fmt: skip
    """The residual stream's tile [BLOCK_M, BLOCK_K] (float32) at rows rm, columns k."""
    inside = (rm[:, None] < M) & (k[None, :] < K)
    if EMBED:
        token = tl.load(ids_ptr + rm, mask=rm < M, other=0)
        x = tl.load(embed_ptr + token[:, None] * K + k[None, :], mask=inside, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + rm[:, None] * stride_x + k[None, :], mask=inside, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + rm[:, None] * K + k[None, :], mask=inside, other=0.0).to(tl.float32)
        x = _round(x + r, X_BF16)
    return x


@triton.jit
def _gemv_kernel(
    a_ptr,  # PLAIN: [M, K] input; NORM: [M, K] residual stream x; SWIGLU: gate [M, K] (rows stride_a)
    up_ptr,  # SWIGLU: up [M, K] (rows stride_up)
    res_ptr,  # [M, K] compute dtype (NORM, HAS_RES)
    ids_ptr,  # [M] int64 (NORM, EMBED)
    embed_ptr,  # [V, K] (NORM, EMBED)
    norm_w_ptr,  # [K] (NORM)
    x_out_ptr,  # [M, K] residual dtype: the new residual stream (NORM, WRITE_X)
    w_ptr,  # [N, K] compute dtype, unit stride in K
    bias_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N] rows stride_y
    M,
    N,
    K,
    stride_a,
    stride_up,
    stride_w,
    stride_y,
    eps,
    PROLOGUE: tl.constexpr,
    EMBED: tl.constexpr,
    HAS_RES: tl.constexpr,
    WRITE_X: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    X_BF16: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    cdt = w_ptr.dtype.element_ty
    if PROLOGUE == 1:  # the row's RMS first (every program: the row is short, the weight is not)
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = _residual(a_ptr, res_ptr, ids_ptr, embed_ptr, rm, k0 + rk, M, K, stride_a,
                          EMBED, HAS_RES, X_BF16)  # fmt: skip
            squares += tl.sum(x * x, 1)
        inv = tl.rsqrt(squares / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        inside = (rm[:, None] < M) & (k[None, :] < K)
        if PROLOGUE == 1:
            x = _residual(a_ptr, res_ptr, ids_ptr, embed_ptr, rm, k, M, K, stride_a, EMBED, HAS_RES, X_BF16)
            if WRITE_X:  # by the first column block's program (the others write no rows)
                writes = tl.where(pid_n == 0, M, 0)
                tl.store(
                    x_out_ptr + rm[:, None] * K + k[None, :],
                    x,
                    mask=(rm[:, None] < writes) & (k[None, :] < K),
                )
            nw = tl.load(norm_w_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            # the trainer: weight * (x * rsqrt).to(dtype), in the residual dtype, then the matmul's cast
            a = _round(nw[None, :] * _round(x * inv[:, None], X_BF16), X_BF16).to(cdt)
        elif PROLOGUE == 2:
            g = tl.load(a_ptr + rm[:, None] * stride_a + k[None, :], mask=inside, other=0.0).to(tl.float32)
            u = tl.load(up_ptr + rm[:, None] * stride_up + k[None, :], mask=inside, other=0.0).to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(cdt).to(tl.float32) * u).to(cdt)  # F.silu rounded, then * up
        else:
            a = tl.load(a_ptr + rm[:, None] * stride_a + k[None, :], mask=inside, other=0.0).to(cdt)
        w = tl.load(w_ptr + rn[None, :] * stride_w + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K),
                    other=0.0)  # fmt: skip
        acc = dot(a, w, acc, PRECISION, UPCAST)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))  # fmt: skip


def _tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages): narrow column blocks, so that even a 896-wide output has
    programs on most SMs, each streaming its weight rows in long pipelined reads."""
    return 16, 128 if k <= 2048 else 256, 4, 4


def gemv(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    up: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    embed: torch.Tensor | None = None,
    x_out: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """y [M, N] = input @ weight.T (+ bias) for M <= ROWS, in weight's dtype. The input is
    - `a` [M, K] itself (rows may be strided);
    - with `up`: silu(a) * up (a the gate, both [M, K], rows may be strided);
    - with `norm_weight`: RMSNorm(x) where x is `a` [M, K] (the residual stream; with `ids` [M] and
      `embed` [V, K], the embedding rows instead), plus `residual` [M, K] when given; x goes to
      `x_out` [M, K] (needed with ids or residual).
    `tiles` (BLOCK_N, BLOCK_K, warps, stages): speed only (bench/gemv_tiles.py)."""
    m, k = a.shape
    n = weight.shape[0]
    if m > ROWS or weight.stride(1) != 1 or a.stride(1) != 1:
        raise ValueError(f"gemv: {m} rows (at most {ROWS}), weight and input unit stride in K")
    prologue = NORM if norm_weight is not None else SWIGLU if up is not None else PLAIN
    write_x = prologue == NORM and (ids is not None or residual is not None)
    if write_x and x_out is None:
        raise ValueError("gemv: the residual stream changes (ids or residual): x_out is needed")
    y = out if out is not None else torch.empty(m, n, dtype=weight.dtype, device=a.device)
    block_n, block_k, warps, stages = tiles or _tiles(n, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        a, up if up is not None else a, residual if residual is not None else a,
        ids if ids is not None else a, embed if embed is not None else a,
        norm_weight if norm_weight is not None else a, x_out if x_out is not None else a,
        weight, bias if bias is not None else weight, y,
        m, n, k, a.stride(0), up.stride(0) if up is not None else 0, weight.stride(0), y.stride(0), eps,
        PROLOGUE=prologue, EMBED=ids is not None, HAS_RES=residual is not None, WRITE_X=write_x,
        HAS_BIAS=bias is not None, X_BF16=(embed if ids is not None else a).dtype == torch.bfloat16,
        PRECISION="ieee" if weight.dtype == torch.float32 else "tf32", UPCAST=UPCAST,  # (float32: no TF32)
        BLOCK_M=ROWS, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
