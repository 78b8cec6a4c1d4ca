"""x [M, K] @ W^T [K, N] (+ b) whose every output's bits are fixed by K alone, never by M.

The K range is cut in chunks of K_CHUNK; a chunk's partial sum starts from zero and runs BLOCK_K at
a time in order; the partials are added in chunk order, then the bias, then one rounding to the
output dtype. Where looping over the chunks in one program would leave processors idle (a decode
step's few rows, a narrow output such as the down projection's at a few hundred rows), each chunk runs
in a program of its own and a second kernel adds the partials; else (prefill, training) one program
loops over the chunks. Both are the same sums in the same order, so both give the same bits, and the
tile shape in M and N does not enter a row's result. cuBLAS gives neither: it splits K by the batch
size.

Past a decode step's few rows the tiles come in through the TMA unit (a descriptor per operand)
where the operands' alignment allows it, else through pointers: the same sums either way
(`bench/exact_matmul.py` checks each tile shape and form to the bit and times them against cuBLAS)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hybridflow.kernels.launch import OPTIONS, UPCAST, dot, interpreted

# A row's bits depend on these two and nothing else. 1024: a 0.5B-1.5B model's hidden size is one
# chunk (one launch at any batch), the MLP's down projection a few (a decode step's parallelism); the
# interpreter's are small for tiny models
BLOCK_K, K_CHUNK = (64, 64) if interpreted() else (64, 1024)
SPLIT_PARTIALS_BYTES = 16 << 20  # past a few hundred rows the loop's grid fills the processors anyway


@triton.jit
def _chunk(x_ptr, w_ptr, rm, rn, M, N, K, k_start, stride_xm, stride_wn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr,
           PRECISION: tl.constexpr):  # fmt: skip
    """One chunk's partial sum [BLOCK_M, BLOCK_N] float32, from zero, k in [k_start, k_start + K_CHUNK)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    rk = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(k_start + K_CHUNK, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0
        )
        b = tl.load(
            w_ptr + rn[None, :] * stride_wn + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0
        )
        acc = dot(a, b, acc, PRECISION, UPCAST)
    return acc


@triton.jit
def _rounded(x, ROUND: tl.constexpr):
    """x (float32) rounded to the dtype named ROUND, kept in float32 (one return type)."""
    if ROUND == "bfloat16":
        x = x.to(tl.bfloat16).to(tl.float32)
    elif ROUND == "float16":
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _finish(total, bias_ptr, res_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS: tl.constexpr,
            HAS_RES: tl.constexpr, ROUND: tl.constexpr):  # fmt: skip
    """y = the sum (+ bias) rounded to ROUND (the matmul's dtype, by name); with HAS_RES, + the
    residual [M, N] (y's dtype and strides) in float32, rounded to y's dtype: torch's `residual + y`."""
    if HAS_BIAS:
        total = total + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    at = rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]  # (M x N may pass 2^31: an LM head's logits)
    out = _rounded(total, ROUND)
    if HAS_RES:
        out = out + tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + at, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Every chunk in this program, added in order."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # 0 + the first chunk, as the ordered sum starts
    for k_start in range(0, K, K_CHUNK):
        total = total + _chunk(x_ptr, w_ptr, rm, rn, M, N, K, k_start, stride_xm, stride_wn,
                               BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION)  # fmt: skip
    _finish(total, bias_ptr, res_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, HAS_RES, ROUND)


@triton.jit
def _tma_chunk(x_desc, w_desc, m0, n0, K, k_start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """_chunk's sum, the tiles loaded by the TMA unit (past the edges: zeros, as the masks)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # a chunk from zero
    for k0 in range(k_start, tl.minimum(k_start + K_CHUNK, K), BLOCK_K):
        a = x_desc.load([m0, k0])  # [BLOCK_M, BLOCK_K]
        b = w_desc.load([n0, k0])  # [BLOCK_N, BLOCK_K]
        acc = dot(a, b.T, acc, PRECISION, UPCAST)
    return acc


@triton.jit(do_not_specialize=["M"])
def _tma_kernel(x_desc, w_desc, bias_ptr, res_ptr, y_ptr, M, N, K, stride_ym,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """_linear_kernel's sums through TMA loads."""
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k_start in range(0, K, K_CHUNK):
        total = total + _tma_chunk(x_desc, w_desc, m0, n0, K, k_start,
                                   BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION)  # fmt: skip
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    _finish(total, bias_ptr, res_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, HAS_RES, ROUND)


@triton.jit(do_not_specialize=["M"])
def _partial_kernel(x_ptr, w_ptr, part_ptr, M, N, K, stride_xm, stride_wn,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    K_CHUNK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Chunk program_id(2)'s partial sum into part [chunks, M, N] float32."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    chunk = tl.program_id(2)
    acc = _chunk(x_ptr, w_ptr, rm, rn, M, N, K, chunk * K_CHUNK, stride_xm, stride_wn,
                 BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION)  # fmt: skip
    _store_partial(part_ptr, acc, chunk, rm, rn, M, N)


@triton.jit(do_not_specialize=["M"])
def _tma_partial_kernel(x_desc, w_desc, part_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_CHUNK: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """_partial_kernel's sum through TMA loads."""
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    chunk = tl.program_id(2)
    acc = _tma_chunk(
        x_desc, w_desc, m0, n0, K, chunk * K_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, PRECISION
    )
    rm = m0 + tl.arange(0, BLOCK_M)
    rn = n0 + tl.arange(0, BLOCK_N)
    _store_partial(part_ptr, acc, chunk, rm, rn, M, N)


@triton.jit
def _store_partial(part_ptr, acc, chunk, rm, rn, M, N):
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    at = (chunk.to(tl.int64) * M + rm.to(tl.int64)[:, None]) * N + rn[None, :]  # part [chunks, M, N]
    tl.store(part_ptr + at, acc, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_partials_kernel(part_ptr, bias_ptr, res_ptr, y_ptr, M, N, stride_ym, CHUNKS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """y = 0 + part[0] + part[1] + ... in chunk order (+ bias). Unrolled: every chunk's load is issued
    before the adds wait on the first (a loop would wait out one memory latency per chunk)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    ptrs = part_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)  # (as the looping kernel: from 0)
    for _ in tl.static_range(CHUNKS):
        total = total + tl.load(ptrs, mask=mask, other=0.0)
        ptrs += M * N  # the next chunk's (64-bit pointers: chunks x M x N may pass 2^31)
    _finish(total, bias_ptr, res_ptr, y_ptr, rm, rn, M, N, stride_ym, HAS_BIAS, HAS_RES, ROUND)


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) for M rows: speed only, the bits do not depend on them. Past
    64 rows, the fastest of bench/exact_matmul.py's sweep on an H100 (TMA loads) for the shape's kind."""
    if interpreted():
        return 16, 128, 1, 1
    if m <= 16:  # weight-read bound: narrow tiles where N is small, for programs on every SM
        return 16, 32 if n <= 4096 else 64, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    if m <= 128:  # (a wide output's 128x256 tiles leave SMs idle here: gate/up 12.8 -> 7.7 us, cuBLAS 7.7)
        return 64, 128, 4, 4
    if n >= 8192:  # wide outputs (gate/up, the LM head): 1.23-1.53x cuBLAS, against 1.7-1.85x before
        return 128, 256, 8, 3
    if m <= 2048:  # a decode step's batch: 1.04-1.55x cuBLAS, against 1.5-2.1x
        return 64, 128, 4, 4
    if k > K_CHUNK:  # a down projection over a training pack: 1.58x, against 2.49x
        return 256, 128, 8, 3
    return 128, 128, 8, 4


def _tma_ready(*tensors: torch.Tensor) -> bool:
    """A TMA descriptor's needs: 16-byte aligned start and row stride."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in tensors)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: tuple[int, int, int, int] | None = None,
    split: bool | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K], weight [N, K], bias [N] (all one dtype, x and weight with unit stride in K) -> [M, N]
    in that dtype. float32 multiplies in full precision (no TF32). tiles: (BLOCK_M, BLOCK_N, warps,
    stages) in place of the row count's own; split: the K chunks in programs of their own (True) or
    looped in one (False) in place of the rule's choice (bench/exact_matmul.py sweeps both: same bits).
    residual [M, N] (any float dtype): residual + the product, added in the epilogue as torch adds them
    (the product rounded to x's dtype first), out in the residual's dtype: a block's residual add
    without a launch of its own."""
    m, k = x.shape
    n = weight.shape[0]
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("linear: x and weight need unit stride along K")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"linear: residual {tuple(residual.shape)} is not the output's ({m}, {n})")
    has_res = residual is not None
    residual = residual.contiguous() if has_res else None
    y = torch.empty(m, n, dtype=residual.dtype if has_res else x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, warps, stages = tiles or _tiles(m, n, k)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # (tf32: ignored for 16-bit inputs)
    chunks = -(-k // K_CHUNK)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    if split is None:  # in waves of programs, one a processor: looped, each program runs all the
        # chunks; split, the chunks fill the processors and the ordered sum costs about one more wave,
        # while its partials stay small enough to come back from L2 (an estimate; the bench times both)
        programs, processors = grid[0] * grid[1], _processors(x.device)
        looped, split_waves = chunks * -(-programs // processors), -(-programs * chunks // processors) + 1
        # (at <= 64 rows, weight-read bound, split from three chunks on where the looped programs
        # leave processors idle; two, e.g. K = 1,536 = 1,024 + 512, at most halve a program's reads for
        # a second launch, and lost at 128 rows; a wide output (a 7B's gate/up, an LM head) fills the
        # processors looped and its partials are as large as its weights: split 125 / 480 us against
        # 99 / 371 looped at 64 rows. bench/exact_matmul.py, H100, 2026-12-07)
        split = (m <= 64 and chunks > 2 and programs < processors) or (
            split_waves < looped and chunks * m * n * 4 <= SPLIT_PARTIALS_BYTES
        )
    has_bias = bias is not None
    bias_arg = bias if has_bias else y
    epilogue = dict(HAS_BIAS=has_bias, HAS_RES=has_res, ROUND=str(x.dtype).removeprefix("torch."))
    res_arg = residual if has_res else y
    # (at <= 64 rows the pointer form's tiles are the tuned ones)
    through_tma = m > 64 and _tma_ready(x, weight)
    if through_tma:
        x_desc = TensorDescriptor.from_tensor(x, [block_m, BLOCK_K])
        w_desc = TensorDescriptor.from_tensor(weight, [block_n, BLOCK_K])
    tile = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, K_CHUNK=K_CHUNK, PRECISION=precision,
                num_warps=warps, num_stages=stages, **OPTIONS)  # fmt: skip
    if split and chunks > 1:  # the chunks in parallel, their sums added in order after
        part = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device)
        if through_tma:
            _tma_partial_kernel[(*grid, chunks)](x_desc, w_desc, part, m, n, k, **tile)
        else:
            _partial_kernel[(*grid, chunks)](x, weight, part, m, n, k, x.stride(0), weight.stride(0), **tile)
        _sum_partials_kernel[grid](
            part, bias_arg, res_arg, y, m, n, y.stride(0), CHUNKS=chunks,
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, **epilogue, **OPTIONS,
        )  # fmt: skip
    elif through_tma:
        _tma_kernel[grid](x_desc, w_desc, bias_arg, res_arg, y, m, n, k, y.stride(0), **epilogue, **tile)
    else:
        _linear_kernel[grid](
            x, weight, bias_arg, res_arg, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
            **epilogue, **tile,
        )  # fmt: skip
    return y


@functools.cache
def _device_processors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _processors(device: torch.device) -> int:
    """Programs that run at once, at one a processor (the interpreter runs one at a time)."""
    if device.type != "cuda":
        return 1
    return _device_processors(device.index if device.index is not None else torch.cuda.current_device())


class _Linear(torch.autograd.Function):
    """The batch-invariant forward; the backward's matmuls are ordinary ones (a gradient's bits
    need not match anything)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype, residual):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dtype).contiguous()  # [M, K]
        w = weight.to(dtype).contiguous()  # [N, K]
        b = bias.to(dtype) if bias is not None else None
        r = residual.reshape(-1, w.shape[0]) if residual is not None else None  # [M, N]
        ctx.save_for_backward(x2, w)
        ctx.shapes = (shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return linear(x2, w, b, residual=r).view(*shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x2, w = ctx.saved_tensors
        shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        g = grad.reshape(-1, w.shape[0]).to(w.dtype)  # [M, N] (the add's gradient, cast as torch's)
        gx = (g @ w).view(shape).to(x_dtype) if ctx.needs_input_grad[0] else None
        gw = (g.T @ x2).to(w_dtype) if ctx.needs_input_grad[1] else None
        gb = g.float().sum(0).to(b_dtype) if b_dtype is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, grad if ctx.needs_input_grad[4] else None


def exact_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """nn.Linear's math in the dtype it would run in (autocast's where on, else x's), batch-invariant;
    differentiable. residual [..., N]: `residual + linear(x)` (in the residual's dtype), the add in
    the matmul's epilogue."""
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return _Linear.apply(x, weight, bias, dtype, residual)
