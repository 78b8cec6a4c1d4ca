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
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, width, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x_raw = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    x = x_raw.to(tl.float32)
    mean_square = tl.sum(x * x, 0) / width
    normed = (x * (1.0 / tl.sqrt_rn(mean_square + eps))).to(x_raw.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (w * normed).to(y_ptr.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in promote(x, weight) dtype."""
    shape, width = x.shape, x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), y, width, rows.stride(0), y.stride(0), eps,
            BLOCK=block, num_warps=4 if block <= 4096 else 8, **OPTIONS,
        )  # fmt: skip
    return y.view(shape)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same math in PyTorch ops (the model's RMSNorm): the backward differentiates this."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
            y = reference_rms_norm(x_, w_, ctx.eps)
            gx, gw = torch.autograd.grad(y, (x_, w_), grad)
        return gx, gw, None


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Batch-invariant RMSNorm, differentiable (the backward is the PyTorch formula's)."""
    return _RMSNorm.apply(x, weight, eps)
