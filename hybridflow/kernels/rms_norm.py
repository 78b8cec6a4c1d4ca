"""RMSNorm with each row's sum of squares in one order whatever the row count: one program per row,
the whole row in one block (torch's reduction picks its split by the tensor's shape). The math is
the model's RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)), the normalized x rounded to x's dtype
before the weight multiplies it, the result in the promoted dtype of the two.

The backward is one launch too (the PyTorch formulas' ~30 elementwise launches a layer were a fifth of
the exact update's GPU time): a program takes ROWS rows in order, writes their input gradient and its
own partial sum of the weight's gradient; the partials are summed by one torch reduction of a fixed
shape. So a backward repeats to the bit; it need not match any other kernel's bits (the forward does)."""

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


# rows a backward program takes (its partial weight gradient sums them in order)
BACKWARD_ROWS = 16


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_backward_kernel(x_ptr, add_ptr, w_ptr, grad_y_ptr, grad_sum_ptr, grad_x_ptr, grad_w_ptr, rows, width,
                              stride_x, stride_add, stride_gy, stride_gs, stride_gx, eps,
                              ADD: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Rows ROWS * p .. ROWS * (p + 1) of program p: the gradient of the normed input (with ADD, of the
    sum s = x + add, recomputed as the forward rounds it, plus the sum's own gradient) in grad_x's
    dtype, and the program's partial weight gradient [width] float32, rows added in order."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    grad_w = tl.zeros([BLOCK], tl.float32)
    for i in range(ROWS):
        row = program.to(tl.int64) * ROWS + i
        mask = inside & ((cols * 0 + row) < rows)  # (a vector: the interpreter masks with one)
        x_raw = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if ADD:
            added = tl.load(add_ptr + row * stride_add + cols, mask=mask, other=0.0).to(tl.float32)
            x_raw = (x_raw.to(tl.float32) + added).to(grad_x_ptr.dtype.element_ty)
        x = x_raw.to(tl.float32)
        mean_square = tl.sum(x * x, 0) / width
        inverse = 1.0 / tl.sqrt_rn(mean_square + eps)
        normed = (x * inverse).to(x_raw.dtype).to(tl.float32)
        grad_y = tl.load(grad_y_ptr + row * stride_gy + cols, mask=mask, other=0.0).to(tl.float32)
        grad_w += grad_y * normed
        grad_normed = grad_y * w
        # x * r with r = (mean(x^2) + eps)^(-1/2): dx = r * dn - x * r^3 * sum(dn * x) / width
        projection = tl.sum(grad_normed * x, 0) * (inverse * inverse * inverse) / width
        grad_x = grad_normed * inverse - x * projection
        if ADD:
            grad_x += tl.load(grad_sum_ptr + row * stride_gs + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_x_ptr + row * stride_gx + cols, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_w_ptr + program.to(tl.int64) * width + cols, grad_w, mask=inside)


def rms_norm_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    grad_y: torch.Tensor,
    add: torch.Tensor | None = None,
    grad_sum: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad of the normed input [..., H] in its dtype, grad of weight [H] in weight's dtype) of
    rms_norm(x, weight, eps[, add]); with `add`, the normed input is the sum x + add (the gradient of
    both x and add) and `grad_sum` [..., H] the sum's own gradient, added in."""
    shape, width = x.shape, x.shape[-1]
    rows, grad_rows = _rows(x), _rows(grad_y)
    stream = torch.promote_types(x.dtype, add.dtype) if add is not None else x.dtype
    added = _rows(add) if add is not None else rows
    grad_sum_rows = _rows(grad_sum) if grad_sum is not None else grad_rows
    grad_x = torch.empty(rows.shape, dtype=stream, device=x.device)
    programs = triton.cdiv(rows.shape[0], BACKWARD_ROWS)
    partials = torch.zeros(max(programs, 1), width, dtype=torch.float32, device=x.device)  # [P, H]
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        _rms_norm_backward_kernel[(programs,)](
            rows, added, weight.contiguous(), grad_rows, grad_sum_rows, grad_x, partials, rows.shape[0], width,
            rows.stride(0), added.stride(0), grad_rows.stride(0), grad_sum_rows.stride(0), grad_x.stride(0), eps,
            ADD=add is not None, ROWS=BACKWARD_ROWS, BLOCK=block, num_warps=4 if block <= 4096 else 8, **OPTIONS,
        )  # fmt: skip
    return grad_x.view(shape), partials.sum(0).to(weight.dtype)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same math in PyTorch ops (the model's RMSNorm): what the kernels' forward and backward
    compute, for tests."""
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
        gx, gw = rms_norm_backward(x, weight, ctx.eps, grad)
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
        grad, gw = rms_norm_backward(x, weight, ctx.eps, grad_y, add=add, grad_sum=grad_sum)
        return grad.to(x.dtype), grad.to(add.dtype), gw, None, None


def exact_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Batch-invariant RMSNorm, differentiable (rms_norm_backward); `dtype`: the
    output's, when the next matmul takes another (its rounding, done here)."""
    return _RMSNorm.apply(x, weight, eps, dtype)


def exact_add_rms_norm(
    x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's `x + add` and its RMSNorm in one launch, batch-invariant: the norm's bits
    are exact_rms_norm's of the sum. Differentiable in all three (rms_norm_backward)."""
    return _AddRMSNorm.apply(x, add, weight, eps, dtype)
