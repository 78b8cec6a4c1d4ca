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


# In the interpreter tl.dot is numpy's matmul of the tile, which multiplies 16-bit floats' stored bits
# and, through the BLAS, may round a row by its place in the tile (seen with OpenBLAS 0.3.31 on an
# AMD EPYC: a row 6 rows into a tile got other bits than the same row at its top). So there the
# product is written out: the values upcast (exact in float32 for 16-bit inputs), multiplied, and
# each output summed over k in order, the same for every row wherever it lies
UPCAST = tl.constexpr(interpreted())  # a constexpr: a jit function reads no other global


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b (float32), as tl.dot; in the interpreter summed in k order, row by row."""
    if UPCAST:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
    if PRECISION == "ieee":  # float32 operands in full precision
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
