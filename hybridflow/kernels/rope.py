"""Rotary position embedding for the exact path in one kernel (the PyTorch form is ~12 launches a
layer): q and k of a token rotated by its position's cos / sin, out in the compute dtype. The math is
the model's `x * cos + rotate_half(x) * sin` in float32 with each product and sum rounded on its own
(no contraction), so it is the PyTorch form's result too, whatever the batch. The backward is the
same kernel rotating the other way."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.kernels.launch import OPTIONS


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, out_ptr, n, out_n, heads, half, stride_xn, stride_xh, stride_cn, stride_on,
            stride_oh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """Token n's `heads` heads of x rotated into row out_n of out."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    inside = (h < heads) & (d < half)
    row = x_ptr + n * stride_xn + h * stride_xh
    x1 = tl.load(row + d, mask=inside, other=0.0).to(tl.float32)
    x2 = tl.load(row + half + d, mask=inside, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + n * stride_cn + d, mask=d < half, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + n * stride_cn + half + d, mask=d < half, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + n * stride_cn + d, mask=d < half, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + n * stride_cn + half + d, mask=d < half, other=0.0).to(tl.float32)
    out = out_ptr + out_n * stride_on + h * stride_oh
    tl.store(out + d, (x1 * c1 + -x2 * s1).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(out + half + d, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, v_out_ptr, slots_ptr, q_heads, k_heads,
                 half, stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_cn, stride_qon, stride_qoh,
                 stride_kon, stride_koh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
                 STORE: tl.constexpr):  # fmt: skip
    """Program (n, 0) rotates token n's q heads, (n, 1) its k heads (k_heads 0: q alone). STORE: k's
    rotation goes to row slots[n] of the cache k_out, and program (n, 2) copies v's row to the same
    row of the cache v_out (rows of [Hkv, D], contiguous)."""
    n = tl.program_id(0).to(tl.int64)
    if STORE:
        to = tl.load(slots_ptr + n)
    else:
        to = n
    column = tl.program_id(1)
    if column == 0:
        _rotate(q_ptr, cos_ptr, sin_ptr, q_out_ptr, n, n, q_heads, half, stride_qn, stride_qh, stride_cn,
                stride_qon, stride_qoh, BLOCK_H, BLOCK_D)  # fmt: skip
    elif column == 1:
        _rotate(k_ptr, cos_ptr, sin_ptr, k_out_ptr, n, to, k_heads, half, stride_kn, stride_kh, stride_cn,
                stride_kon, stride_koh, BLOCK_H, BLOCK_D)  # fmt: skip
    else:
        width = k_heads * 2 * half
        i = tl.arange(0, BLOCK_V)
        row = tl.load(v_ptr + n * stride_vn + i, mask=i < width)
        tl.store(v_out_ptr + to * width + i, row.to(v_out_ptr.dtype.element_ty), mask=i < width)


def rope_qk(
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dtype: torch.dtype,
    *,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """q [N, Hq, D], k [N, Hkv, D] or None (unit stride in D), cos / sin [N, D] float32 -> (q, k) rotated
    in `dtype`, in one launch; each with the bits `rope` gives it alone. store: (k_cache, v_cache
    [S, Hkv, D] in `dtype`, slots [N] int64, v [N, Hkv, D]): k's rotation goes to its rows `slots` of
    k_cache and v to v_cache's, in the same launch (-> (q, None): the engine's K/V store)."""
    n, q_heads, dim = q.shape
    k_heads = k.shape[1] if k is not None else 0
    q_out = torch.empty(n, q_heads, dim, dtype=dtype, device=q.device)
    if store is not None:
        k_cache, v_cache, slots, v = store
        if k is None or k_cache.dtype != dtype or v_cache.dtype != dtype:
            raise ValueError(f"rope_qk: the K/V store takes k and a {dtype} cache, not {k_cache.dtype}")
        v = v if v.stride(2) == 1 and v.stride(1) == dim else v.contiguous()  # (a row's Hkv x D in one run)
        k_out, v_arg, v_out, slots_arg = k_cache, v, v_cache, slots
    else:
        k_out = torch.empty(n, k_heads, dim, dtype=dtype, device=q.device) if k is not None else None
        v_arg = v_out = slots_arg = q_out  # (never read: no program of a third column)
    k_in, k_to = (k, k_out) if k is not None else (q, q_out)  # (never read: no program of a second column)
    columns = 3 if store is not None else 2 if k is not None else 1
    if n:
        _rope_kernel[(n, columns)](
            q, k_in, v_arg, cos, sin, q_out, k_to, v_out, slots_arg, q_heads, k_heads, dim // 2, q.stride(0),
            q.stride(1), k_in.stride(0), k_in.stride(1), v_arg.stride(0), cos.stride(0), q_out.stride(0),
            q_out.stride(1), k_to.stride(0), k_to.stride(1),
            BLOCK_H=triton.next_power_of_2(max(q_heads, k_heads)), BLOCK_D=triton.next_power_of_2(dim // 2),
            BLOCK_V=triton.next_power_of_2(max(k_heads, 1) * dim), STORE=store is not None, num_warps=1,
            **OPTIONS,
        )  # fmt: skip
    return q_out, None if store is not None else k_out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [N, H, D] (unit stride in D), cos / sin [N, D] float32 -> rotated [N, H, D] in `dtype`."""
    return rope_qk(x, None, cos, sin, dtype)[0]


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model's PyTorch form (what the kernel computes, for tests)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(dtype)


class _RopeQK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, dtype):
        ctx.save_for_backward(q, k, cos, sin)
        ctx.dtype = dtype
        return rope_qk(q, k, cos, sin, dtype)

    @staticmethod
    def backward(ctx, grad_q, grad_k):
        q, k, cos, sin = ctx.saved_tensors
        # the rotation's transpose is the rotation with sin' = -(sin's halves swapped): (g1 c1 + g2 s2,
        # g2 c2 - g1 s1), the products and sums the PyTorch form's backward rounds
        half = sin.shape[-1] // 2
        sin_back = -torch.cat((sin[:, half:], sin[:, :half]), dim=-1)  # [N, D]
        grad_q = grad_q if grad_q.stride(-1) == 1 else grad_q.contiguous()
        grad_k = grad_k if grad_k.stride(-1) == 1 else grad_k.contiguous()
        gq, gk = rope_qk(grad_q, grad_k, cos, sin_back, q.dtype)
        return gq, gk.to(k.dtype), None, None, None


def exact_rope_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dtype: torch.dtype,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """Batch-invariant rotary of q and k in one launch, differentiable in both; store: the engine's
    K/V store in the same launch (rope_qk's; no gradients there)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    if store is not None:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            raise ValueError("exact_rope_qk: the K/V store is the engine's, without gradients")
        return rope_qk(q, k, cos, sin, dtype, store=store)
    return _RopeQK.apply(q, k, cos, sin, dtype)
