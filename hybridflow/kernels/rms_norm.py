"""RMSNorm with each row's sum of squares in one order whatever the row count: one program per row,
the whole row in one block (torch's reduction picks its split by the tensor's shape). The math is
the model's RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)), the normalized x rounded to x's dtype
before the weight multiplies it, the result in the promoted dtype of the two."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.kernels.launch import OPTIONS


@triton.jit
def _rms_norm_kernel(x_ptr, add_ptr, sum_ptr, w_ptr, y_ptr, width, stride_x, stride_add, stride_sum, stride_y, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One row: y = w * norm(x) or, with ADD, the residual stream's next value s = x + add (stored, in
    the promoted dtype) and y = w * norm(s); y in y's dtype (a matmul's input dtype saves its cast)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    if ADD:  # the sum in float32, rounded once to the promoted dtype, as `x + add`
        added = tl.load(add_ptr + row * stride_add + cols, mask=inside, other=0.0).to(tl.float32)
        x_raw = (x_raw.to(tl.float32) + added).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x_raw, mask=inside)
    x = x_raw.to(tl.float32)
    mean_square = tl.sum(x * x, 0) / width
    normed = (x * (1.0 / tl.sqrt_rn(mean_square + eps))).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=inside)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    add: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
):
    """x [..., H], weight [H] -> y [..., H] in `dtype` (default promote(x, weight): the model's), or with
    `add` [..., H] -> (x + add, the residual stream's next value in the promoted dtype; y of it)."""
    shape, width = x.shape, x.shape[-1]
    rows = _rows(x)
    stream = torch.promote_types(x.dtype, add.dtype) if add is not None else x.dtype  # what is normed
    y = torch.empty(rows.shape, dtype=dtype or torch.promote_types(stream, weight.dtype), device=x.device)
    added = _rows(add) if add is not None else rows
    total = torch.empty(rows.shape, dtype=stream, device=x.device) if add is not None else rows
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, added, total, weight.contiguous(), y, width, rows.stride(0), added.stride(0), total.stride(0),
            y.stride(0), eps, ADD=add is not None, BLOCK=block, num_warps=4 if block <= 4096 else 8, **OPTIONS,
        )  # fmt: skip
    if add is None:
        return y.view(shape)
    return total.view(shape), y.view(shape)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same math in PyTorch ops (the model's RMSNorm): the backward differentiates this."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, dtype):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.dtype = eps, dtype
        return rms_norm(x, weight, eps, dtype=dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = reference_rms_norm(x_, w_, ctx.eps)
            gx, gw = torch.autograd.grad(y.to(grad.dtype), (x_, w_), grad)
        return gx, gw, None, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, add, weight, eps, dtype):
        ctx.save_for_backward(x, add, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps, add=add, dtype=dtype)

    @staticmethod
    def backward(ctx, grad_sum, grad_y):
        x, add, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, a_, w_ = (t.detach().requires_grad_() for t in (x, add, weight))
            total = x_ + a_
            y = reference_rms_norm(total, w_, ctx.eps).to(grad_y.dtype)
            gx, ga, gw = torch.autograd.grad((total, y), (x_, a_, w_), (grad_sum, grad_y))
        return gx, ga, gw, None, None


def exact_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Batch-invariant RMSNorm, differentiable (the backward is the PyTorch formula's); `dtype`: the
    output's, when the next matmul takes another (its rounding, done here)."""
    return _RMSNorm.apply(x, weight, eps, dtype)


def exact_add_rms_norm(
    x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's `x + add` and its RMSNorm in one launch, batch-invariant: the norm's bits
    are exact_rms_norm's of the sum. Differentiable in all three (the PyTorch formulas' backward)."""
    return _AddRMSNorm.apply(x, add, weight, eps, dtype)
