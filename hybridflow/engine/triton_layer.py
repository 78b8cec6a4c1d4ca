"""The small kernels of a fused decode step, in Triton: each replaces several PyTorch kernels of the
trainer's layer with one, rounding where the trainer rounds, so the engine computes the trainer's
numbers (up to the order of a sum).

- `rms_norm`: the embedding lookup or the residual add, then RMSNorm, cast for the next matmul.
- `rope_store`: (Qwen3's per-head norm,) rotary on q and k, k and v into their cache slots.
- `store_kv`: k and v into their cache slots (the model's own layers: exact, prefill).
- `silu_mul`: SwiGLU's gate.
- `prepare_step`: a decode step's cache slots, context lengths and noise keys, from device state.

`X_BF16` says the residual stream's dtype (the trainer's master dtype: float32, or bfloat16 for a
model held in bf16): the trainer rounds its norms and rotary to it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.engine.triton_sampler import _mix31  # the sampler's noise hash, shared


@triton.jit
def _round(x, X_BF16: tl.constexpr):
    """x (float32) rounded to the residual dtype, kept in float32."""
    if X_BF16:
        return x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [B, H] residual stream: read, and written when EMBED or HAS_RES
    res_ptr,  # [B, H] compute dtype: added to x first (HAS_RES)
    ids_ptr,  # [B] int64 token ids (EMBED)
    embed_ptr,  # [V, H] embedding (EMBED)
    w_ptr,  # [H] norm weight
    out_ptr,  # [B, H] compute dtype
    hidden,
    eps,
    EMBED: tl.constexpr,
    HAS_RES: tl.constexpr,
    X_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < hidden
    if EMBED:
        token = tl.load(ids_ptr + row)
        x = tl.load(embed_ptr + token * hidden + cols, mask=inside, other=0.0).to(tl.float32)
    else:
        x = tl.load(x_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(res_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
        x = _round(x + r, X_BF16)
    if EMBED or HAS_RES:
        tl.store(x_ptr + row * hidden + cols, x, mask=inside)
    inv = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    y = _round(w * _round(x * inv, X_BF16), X_BF16)  # the trainer: weight * (x * rsqrt).to(dtype)
    tl.store(out_ptr + row * hidden + cols, y, mask=inside)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    ids: torch.Tensor | None = None,
    embed: torch.Tensor | None = None,
) -> None:
    """x [B, H] (residual dtype, contiguous): with `ids` and `embed` it is filled with the
    embeddings first; with `residual` [B, H] it gets x + residual in place. Then
    out [B, H] = RMSNorm(x) in out's dtype."""
    b, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(b,)](
        x, residual if residual is not None else x, ids if ids is not None else x,
        embed if embed is not None else x, weight, out, hidden, eps,
        EMBED=ids is not None, HAS_RES=residual is not None, X_BF16=x.dtype == torch.bfloat16,
        BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip


@triton.jit
def _rope_store_kernel(
    q_ptr,  # [B, Hq * D] rows of stride_q (a view of the fused QKV output, or q_proj's)
    k_ptr,  # [B, Hkv * D], stride_k
    v_ptr,  # [B, Hkv * D], stride_v
    cos_ptr,  # [T, D]
    sin_ptr,
    pos_ptr,  # [B] int64
    slots_ptr,  # [B] int64
    q_out_ptr,  # [B, Hq, D] compute dtype
    k_out_ptr,  # [B, Hkv, D] the rotated k as well (K_OUT: prefill attends to it directly)
    k_cache_ptr,  # [S, Hkv, D]
    v_cache_ptr,
    qn_ptr,  # [D] q_norm weight (QK_NORM)
    kn_ptr,
    stride_q,
    stride_k,
    stride_v,
    q_heads,
    kv_heads,
    eps,
    QK_NORM: tl.constexpr,
    X_BF16: tl.constexpr,
    K_OUT: tl.constexpr,
    HALF: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    is_q = h < q_heads
    kv = h - q_heads
    if is_q:
        src = q_ptr + b * stride_q + h * 2 * HALF
    else:
        src = k_ptr + b * stride_k + kv * 2 * HALF
    x1 = tl.load(src + d).to(tl.float32)
    x2 = tl.load(src + HALF + d).to(tl.float32)
    if QK_NORM:  # the trainer: weight * (x * rsqrt).to(x's compute dtype), over one head
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        if is_q:
            w1 = tl.load(qn_ptr + d).to(tl.float32)
            w2 = tl.load(qn_ptr + HALF + d).to(tl.float32)
        else:
            w1 = tl.load(kn_ptr + d).to(tl.float32)
            w2 = tl.load(kn_ptr + HALF + d).to(tl.float32)
        cdt = q_out_ptr.dtype.element_ty
        x1 = _round(w1 * (x1 * inv).to(cdt).to(tl.float32), X_BF16)
        x2 = _round(w2 * (x2 * inv).to(cdt).to(tl.float32), X_BF16)
    p = tl.load(pos_ptr + b)
    c1 = tl.load(cos_ptr + p * 2 * HALF + d).to(tl.float32)
    c2 = tl.load(cos_ptr + p * 2 * HALF + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + p * 2 * HALF + d).to(tl.float32)
    s2 = tl.load(sin_ptr + p * 2 * HALF + HALF + d).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    o1 = _round(_round(x1 * c1, X_BF16) - _round(x2 * s1, X_BF16), X_BF16)
    o2 = _round(_round(x2 * c2, X_BF16) + _round(x1 * s2, X_BF16), X_BF16)
    if is_q:
        dst = q_out_ptr + (b * q_heads + h) * 2 * HALF
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
    else:
        slot = tl.load(slots_ptr + b)
        dst = k_cache_ptr + (slot * kv_heads + kv) * 2 * HALF
        tl.store(dst + d, o1)
        tl.store(dst + HALF + d, o2)
        if K_OUT:
            k_dst = k_out_ptr + (b * kv_heads + kv) * 2 * HALF
            tl.store(k_dst + d, o1)
            tl.store(k_dst + HALF + d, o2)
        v_src = v_ptr + b * stride_v + kv * 2 * HALF
        v_dst = v_cache_ptr + (slot * kv_heads + kv) * 2 * HALF
        tl.store(v_dst + d, tl.load(v_src + d))
        tl.store(v_dst + HALF + d, tl.load(v_src + HALF + d))


def rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_out: torch.Tensor | None = None,
) -> None:
    """q [B, Hq*D], k/v [B, Hkv*D] (rows may be strided: views of one QKV output); cos/sin [T, D];
    pos, slots [B] -> q_out [B, Hq, D] rotated; k rotated and v into k/v_cache [S, Hkv, D] at slots.
    q_norm/k_norm [D]: the per-head RMSNorm of Qwen3, before rotary. k_out [B, Hkv, D]: gets the
    rotated k too."""
    b, q_heads, head_dim = q_out.shape
    kv_heads = k_cache.shape[1]
    qk_norm = q_norm is not None
    _rope_store_kernel[(b, q_heads + kv_heads)](
        q, k, v, cos, sin, pos, slots, q_out, k_out if k_out is not None else q_out, k_cache, v_cache,
        q_norm if qk_norm else cos, k_norm if qk_norm else cos,
        q.stride(0), k.stride(0), v.stride(0), q_heads, kv_heads, eps,
        QK_NORM=qk_norm, X_BF16=cos.dtype == torch.bfloat16, K_OUT=k_out is not None, HALF=head_dim // 2,
        num_warps=1,
    )  # fmt: skip


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, slots_ptr, k_cache_ptr, v_cache_ptr, stride_k, stride_v, width,
                     BLOCK: tl.constexpr):  # fmt: skip
    """Program (n, 0) copies row n of k ([Hkv * D] from k_ptr + n * stride_k) to its slot's row of
    k_cache, (n, 1) the same for v, cast to the cache's dtype."""
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + n)
    i = tl.arange(0, BLOCK)
    inside = i < width
    if tl.program_id(1) == 0:
        row = tl.load(k_ptr + n * stride_k + i, mask=inside).to(k_cache_ptr.dtype.element_ty)
        tl.store(k_cache_ptr + slot * width + i, row, mask=inside)
    else:
        row = tl.load(v_ptr + n * stride_v + i, mask=inside).to(v_cache_ptr.dtype.element_ty)
        tl.store(v_cache_ptr + slot * width + i, row, mask=inside)


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
):
    """k/v [N, Hkv, D] (each row's Hkv x D contiguous) -> k/v_cache [S, Hkv, D] rows `slots` [N] int64,
    in one launch (torch's index_copy_ is two, and under deterministic algorithms a sort each)."""
    n, kv_heads, dim = k.shape
    if n == 0:
        return
    _store_kv_kernel[(n, 2)](
        k, v, slots, k_cache, v_cache, k.stride(0), v.stride(0), kv_heads * dim,
        BLOCK=triton.next_power_of_2(kv_heads * dim), num_warps=1,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, stride_g, stride_u, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    g = tl.load(gate_ptr + row * stride_g + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=inside, other=0.0).to(tl.float32)
    cdt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(cdt).to(tl.float32)  # F.silu, rounded as the trainer's
    tl.store(out_ptr + row * width + cols, act * u, mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, *, block: int = 1024) -> None:
    """gate, up [B, I] (rows may be strided: halves of one gate/up output) -> out [B, I] =
    silu(gate) * up in out's dtype."""
    b, width = out.shape
    _silu_mul_kernel[(b, triton.cdiv(width, block))](
        gate, up, out, gate.stride(0), up.stride(0), width, BLOCK=block, num_warps=4
    )


@triton.jit(do_not_specialize=["rows", "stride_t"])
def _prepare_step_kernel(
    step_ptr,  # [1] int64: the step of the run about to be computed; +1 here
    pos_ptr,  # [R] int64 position of each row's input token
    limit_ptr,  # [R] int64 steps the row may take this run
    table_ptr,  # [R, P] int32 page table
    seeds_ptr,  # [R] int64
    generated_ptr,  # [R] int64 tokens generated before the run
    slots_ptr,  # [R] int64 out: the cache slot of the input token (0: the scratch page)
    ctx_ptr,  # [R] int32 out: context length (0: a padded row)
    keys_ptr,  # [R] int64 out: the step's noise key
    rows,
    stride_t,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k = tl.load(step_ptr)
    for start in range(0, rows, BLOCK):
        r = start + tl.arange(0, BLOCK)
        inside = r < rows
        pos = tl.load(pos_ptr + r, mask=inside, other=0)
        limit = tl.load(limit_ptr + r, mask=inside, other=0)
        page = tl.load(table_ptr + r * stride_t + pos // PAGE, mask=inside, other=0).to(tl.int64)
        slot = tl.where(limit > k, page * PAGE + pos % PAGE, 0)
        tl.store(slots_ptr + r, slot, mask=inside)
        tl.store(ctx_ptr + r, tl.where(limit > 0, pos + 1, 0).to(tl.int32), mask=inside)
        seed = tl.load(seeds_ptr + r, mask=inside, other=0)
        step = tl.load(generated_ptr + r, mask=inside, other=0) + k
        # sampler.step_keys in 32 bits (its hash's low 31 bits depend only on the operands' low 31)
        key = _mix31(_mix31((seed & 0x7FFFFFFF).to(tl.uint32)) ^ (step & 0x7FFFFFFF).to(tl.uint32))
        tl.store(keys_ptr + r, key.to(tl.int64), mask=inside)
    tl.store(step_ptr, k + 1)  # one program: every read above came first


def prepare_step(
    step: torch.Tensor,
    pos: torch.Tensor,
    limit: torch.Tensor,
    table: torch.Tensor,
    seeds: torch.Tensor,
    generated: torch.Tensor,
    slots: torch.Tensor,
    ctx: torch.Tensor,
    keys: torch.Tensor,
    page_size: int,
) -> None:
    rows = pos.shape[0]
    _prepare_step_kernel[(1,)](
        step, pos, limit, table, seeds, generated, slots, ctx, keys, rows, table.stride(0),
        PAGE=page_size, BLOCK=128, num_warps=4,  # one compiled kernel for every batch size
    )  # fmt: skip
