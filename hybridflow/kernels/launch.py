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


# An int argument that changes with the batch (a row count, a table's width, a count of key chunks or
# of sampler slices) is named in its kernel's do_not_specialize: Triton compiles a variant of its own for
# an int equal to 1 or divisible by 16, ~0.3-1 s on an H100, and a batch that first meets one inside a
# timed step (a prefill whose packed prompts come to a multiple of 16 tokens) carries that compile.
# The masks are all such a count feeds, so the variants' code gains nothing (bench/compile_log.py
# lists the compiles a training run does, step by step)

# No fused multiply-add contraction: a * b + c rounds twice in every kernel, so the merge of two
# partial results is the same arithmetic in the kernel that loops and in the one that reduces
OPTIONS = {} if interpreted() else {"enable_fp_fusion": False}


# In the interpreter tl.dot is numpy's matmul of the tile, which multiplies 16-bit floats' stored bits
# and, through the BLAS, may round a row by its place in the tile (seen with OpenBLAS 0.3.31 on an
# AMD EPYC: a row 6 rows into a tile got other bits than the same row at its top). So there the
# product is written out: the values upcast (exact in float32 for 16-bit inputs), multiplied, and
# each output summed over k in order, the same for every row wherever it lies. (A running sum: numpy's
# np.sum picks its order by the operands' memory layout, which differs for a transposed tile)
UPCAST = tl.constexpr(interpreted())  # a constexpr: a jit function reads no other global


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b (float32), as tl.dot; in the interpreter summed in k order, row by row."""
    if UPCAST:
        products = a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :]  # [M, K, N]
        running = tl.cumsum(products, 1)  # k in order, whatever the layout
        last = (tl.arange(0, a.shape[1]) == a.shape[1] - 1)[None, :, None]
        return acc + tl.sum(tl.where(last, running, 0.0), 1)  # (the one nonzero term: exact)
    if PRECISION == "ieee":  # float32 operands in full precision
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)
