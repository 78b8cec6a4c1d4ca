"""Rotary position embedding for the exact path in one kernel (the PyTorch form is ~12 launches a
layer): q and k of a token rotated by its position's cos / sin, out in the compute dtype. The math is
the model's `x * cos + rotate_half(x) * sin` in float32 with each product and sum rounded on its own
(no contraction), so it is the PyTorch form's result too, whatever the batch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.kernels.launch import OPTIONS


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, half, stride_xn, stride_xh, stride_cn, stride_on,
                 stride_oh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
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
    out = out_ptr + n * stride_on + h * stride_oh
    tl.store(out + d, (x1 * c1 + -x2 * s1).to(out_ptr.dtype.element_ty), mask=inside)
    tl.store(out + half + d, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=inside)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [N, H, D] (unit stride in D), cos / sin [N, D] float32 -> rotated [N, H, D] in `dtype`."""
    n, heads, dim = x.shape
    out = torch.empty(n, heads, dim, dtype=dtype, device=x.device)
    if n:
        half = dim // 2
        _rope_kernel[(n,)](
            x, cos, sin, out, heads, half, x.stride(0), x.stride(1), cos.stride(0), out.stride(0), out.stride(1),
            BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half), num_warps=1, **OPTIONS,
        )  # fmt: skip
    return out


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model's PyTorch form (the backward differentiates it)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos[:, None, :] + rotated * sin[:, None, :]).to(dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, dtype):
        ctx.save_for_backward(x, cos, sin)
        ctx.dtype = dtype
        return rope(x, cos, sin, dtype)

    @staticmethod
    def backward(ctx, grad):
        x, cos, sin = ctx.saved_tensors
        with torch.enable_grad():
            x_ = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(reference_rope(x_, cos, sin, ctx.dtype), (x_,), grad)
        return gx, None, None, None


def exact_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Batch-invariant rotary in one launch, differentiable in x."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _Rope.apply(x, cos, sin, dtype)
