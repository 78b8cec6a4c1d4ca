"""What every batch-invariant kernel launch shares: whether Triton runs in its interpreter (tests
on CPU tensors), and the compile options that make one written sum round one way in every kernel."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreted() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1, read when triton is imported): kernels on CPU
    tensors through numpy, tile by tile; the tile shapes are then fixed, since numpy's matmul of a
    tile rounds a row by the tile's shape."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def supported(device: torch.device) -> bool:
    return device.type == "cuda" or interpreted()


# No fused multiply-add contraction: a * b + c rounds twice in every kernel, so the merge of two
# partial results is the same arithmetic in the kernel that loops and in the one that reduces
OPTIONS = {} if interpreted() else {"enable_fp_fusion": False}


# The interpreter multiplies 16-bit floats' stored bits in tl.dot: its kernels take the product of
# the values, upcast (exact in float32 for bfloat16 and float16 inputs)
UPCAST = tl.constexpr(interpreted())  # a constexpr: a jit function reads no other global


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b (float32), as tl.dot; the interpreter's operands upcast first."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if PRECISION == "ieee":  # float32 operands in full precision
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
