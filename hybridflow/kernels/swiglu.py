"""The MLP's `silu(gate) * up` for the exact path in one launch (PyTorch's form is two, with the
activation written out between them). Elementwise, so batch-invariant by nature; the math is the
PyTorch form's in float32, silu(g) = g / (1 + exp(-g)) rounded to the inputs' dtype before the
product, the product rounded once. Trainer and engine both call it, so their bits agree whatever
the exp's last bit."""

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


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return silu_mul(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g_, u_ = gate.detach().requires_grad_(), up.detach().requires_grad_()
            gg, gu = torch.autograd.grad(torch.nn.functional.silu(g_) * u_, (g_, u_), grad)
        return gg, gu


def exact_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one launch, differentiable (the PyTorch form's backward); [..., I] shapes."""
    shape = gate.shape
    gate2, up2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1:
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    return _SiluMul.apply(gate2, up2).view(shape)
