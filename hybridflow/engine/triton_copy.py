"""Many tensors copied (and cast) by one Triton launch per dtype pair: the engine's weight update.

A copy per tensor costs a kernel launch each (~300 for a 0.5B model), and torch's multi-tensor copy
takes its fast path only when source and destination dtypes agree (fp32 trainer -> bf16 engine
does not). Here every tensor is addressed as an element offset from the lowest-addressed tensor of
its group, and each program copies one chunk of one tensor, looked up in a chunk table. The plan
(tables on the device) is built once and relaunched while the tensors stay where they are."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Measured on the H200 with `bench/weight_update.py` (docs/benchmarks.md).
BLOCK = 2048
ITERS = 16
NUM_WARPS = 4


@triton.jit
def _cast_copy_kernel(
    src_base,  # the group's lowest-addressed source; every source is an element offset from it
    dst_base,
    chunk_tensor_ptr,  # [chunks] int32: which tensor this program copies
    chunk_index_ptr,  # [chunks] int32: which chunk (BLOCK * ITERS elements) of it
    src_off_ptr,  # [tensors] int64, in elements
    dst_off_ptr,
    numel_ptr,  # [tensors] int64
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor_ptr + pid)
    first = tl.load(chunk_index_ptr + pid).to(tl.int64) * (BLOCK * ITERS)
    numel = tl.load(numel_ptr + t)
    src = src_base + tl.load(src_off_ptr + t)
    dst = dst_base + tl.load(dst_off_ptr + t)
    for i in tl.static_range(ITERS):  # unrolled: ITERS loads in flight per table lookup
        idx = first + i * BLOCK + tl.arange(0, BLOCK)
        mask = idx < numel
        x = tl.load(src + idx, mask=mask)
        tl.store(dst + idx, x.to(dst_base.dtype.element_ty), mask=mask)


class _Group:
    """One dtype pair's copies as a single launch."""

    def __init__(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], block: int, iters: int, warps: int
    ):
        self.src_base = min(srcs, key=torch.Tensor.data_ptr)
        self.dst_base = min(dsts, key=torch.Tensor.data_ptr)
        device = self.src_base.device
        numels = [s.numel() for s in srcs]
        chunks = [-(-n // (block * iters)) for n in numels]
        self.chunk_tensor = torch.repeat_interleave(
            torch.arange(len(srcs), dtype=torch.int32), torch.tensor(chunks)
        ).to(device)
        self.chunk_index = torch.cat([torch.arange(n, dtype=torch.int32) for n in chunks]).to(device)
        self.src_off = _element_offsets(srcs, self.src_base).to(device)
        self.dst_off = _element_offsets(dsts, self.dst_base).to(device)
        self.numel = torch.tensor(numels, dtype=torch.int64, device=device)
        self.block, self.iters, self.warps = block, iters, warps

    def launch(self) -> None:
        _cast_copy_kernel[(self.chunk_tensor.numel(),)](
            self.src_base, self.dst_base, self.chunk_tensor, self.chunk_index, self.src_off,
            self.dst_off, self.numel, BLOCK=self.block, ITERS=self.iters, num_warps=self.warps,
        )  # fmt: skip


def _element_offsets(tensors: list[torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    size = base.element_size()
    offsets = [t.data_ptr() - base.data_ptr() for t in tensors]
    assert all(o % size == 0 for o in offsets)  # tensors of one dtype are aligned to their element
    return torch.tensor([o // size for o in offsets], dtype=torch.int64)


class CastCopyPlan:
    """dst.copy_(src) for every pair (contiguous tensors, equal numel), one launch per dtype pair.
    The sources and destinations must stay alive and in place while the plan is used."""

    def __init__(
        self,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        *,
        block: int = BLOCK,
        iters: int = ITERS,
        warps: int = NUM_WARPS,
    ) -> None:
        by_dtypes: dict[tuple, tuple[list, list]] = {}
        for dst, src in zip(dsts, srcs, strict=True):
            assert dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()
            if dst.numel():
                pair = by_dtypes.setdefault((dst.dtype, src.dtype), ([], []))
                pair[0].append(dst)
                pair[1].append(src)
        self.groups = [_Group(d, s, block, iters, warps) for d, s in by_dtypes.values()]

    def __call__(self) -> None:
        for group in self.groups:
            group.launch()


def cast_copy_triton(dsts: list[torch.Tensor], srcs: list[torch.Tensor], **settings) -> None:
    CastCopyPlan(dsts, srcs, **settings)()
