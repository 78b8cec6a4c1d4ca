"""The MLP's `silu(gate) * up` for the exact path in one launch (PyTorch's form is two, with the
activation written out between them). Elementwise, so batch-invariant by nature; the math is the
PyTorch form's in float32, silu(g) = g / (1 + exp(-g)) rounded to the inputs' dtype before the
product, the product rounded once. Trainer and engine both call it, so their bits agree whatever
the exp's last bit. The backward is one launch as well (silu_mul_backward)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridflow.kernels.launch import OPTIONS

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_ptr, up_ptr, out_ptr, width, stride_gate, stride_up, stride_out, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=inside, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=inside, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (activated * up).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] (one dtype, unit stride in I; column views of one matmul are fine) -> [N, I]."""
    n, width = gate.shape
    out = torch.empty(n, width, dtype=gate.dtype, device=gate.device)
    if n:
        _silu_mul_kernel[(n, triton.cdiv(width, BLOCK))](
            gate,
            up,
            out,
            width,
            gate.stride(0),
            up.stride(0),
            out.stride(0),
            BLOCK=BLOCK,
            num_warps=4,
            **OPTIONS,
        )
    return out


@triton.jit
def _silu_mul_backward_kernel(gate_ptr, up_ptr, grad_ptr, grad_gate_ptr, grad_up_ptr, width, stride_gate, stride_up,
                              stride_grad, stride_grad_gate, stride_grad_up, BLOCK: tl.constexpr):  # fmt: skip
    """d up = grad * silu(gate) (the forward's rounded activation), d gate = grad * up * silu'(gate) with
    silu'(g) = s (1 + g (1 - s)), s = sigmoid(g); in float32, each rounded once to its output's dtype."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=inside, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=inside, other=0.0).to(tl.float32)
    grad = tl.load(grad_ptr + row * stride_grad + cols, mask=inside, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    denominator = 1.0 + tl.exp(-g)
    sigmoid = 1.0 / denominator
    activated = (g / denominator).to(gate.dtype).to(tl.float32)  # (the forward's rounded activation)
    tl.store(grad_up_ptr + row * stride_grad_up + cols, (grad * activated).to(grad_up_ptr.dtype.element_ty),
             mask=inside)  # fmt: skip
    slope = sigmoid * (1.0 + g * (1.0 - sigmoid))
    tl.store(grad_gate_ptr + row * stride_grad_gate + cols, (grad * up * slope).to(grad_gate_ptr.dtype.element_ty),
             mask=inside)  # fmt: skip


def silu_mul_backward(
    gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) [N, I] of silu_mul(gate, up) under the output's gradient `grad` [N, I], in one
    launch (PyTorch's form is five)."""
    n, width = gate.shape
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    grad_gate = torch.empty(n, width, dtype=gate.dtype, device=gate.device)
    grad_up = torch.empty(n, width, dtype=up.dtype, device=up.device)
    if n:
        _silu_mul_backward_kernel[(n, triton.cdiv(width, BLOCK))](
            gate, up, grad, grad_gate, grad_up, width, gate.stride(0), up.stride(0), grad.stride(0),
            grad_gate.stride(0), grad_up.stride(0), BLOCK=BLOCK, num_warps=4, **OPTIONS,
        )  # fmt: skip
    return grad_gate, grad_up


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return silu_mul_backward(gate, up, grad)


def exact_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one launch, differentiable (silu_mul_backward); [..., I] shapes."""
    shape = gate.shape
    gate2, up2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1:
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    return _SiluMul.apply(gate2, up2).view(shape)
