"""Many tensors copied (and cast) by one Triton launch per dtype pair: the engine's weight update.

A copy per tensor costs a kernel launch each (~300 for a 0.5B model), and torch's multi-tensor copy
takes its fast path only when source and destination dtypes agree (fp32 trainer -> bf16 engine
does not). Here every tensor is addressed as an element offset from the lowest-addressed tensor of
its group, and each program copies one BLOCK of one tensor, looked up in a block table. The plan
(tables on the device) is built once and relaunched while the tensors stay where they are."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 8192


@triton.jit
def _cast_copy_kernel(
    src_base,  # the group's lowest-addressed source; every source is an element offset from it
    dst_base,
    block_tensor_ptr,  # [blocks] int32: which tensor this program copies
    block_index_ptr,  # [blocks] int32: which BLOCK of it
    src_off_ptr,  # [tensors] int64, in elements
    dst_off_ptr,
    numel_ptr,  # [tensors] int64
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor_ptr + pid)
    idx = tl.load(block_index_ptr + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < tl.load(numel_ptr + t)
    x = tl.load(src_base + tl.load(src_off_ptr + t) + idx, mask=mask)
    tl.store(dst_base + tl.load(dst_off_ptr + t) + idx, x.to(dst_base.dtype.element_ty), mask=mask)


class _Group:
    """One dtype pair's copies as a single launch."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], block: int) -> None:
        self.src_base = min(srcs, key=torch.Tensor.data_ptr)
        self.dst_base = min(dsts, key=torch.Tensor.data_ptr)
        device = self.src_base.device
        numels = [s.numel() for s in srcs]
        blocks = [-(-n // block) for n in numels]
        self.block_tensor = torch.repeat_interleave(
            torch.arange(len(srcs), dtype=torch.int32), torch.tensor(blocks)
        ).to(device)
        self.block_index = torch.cat([torch.arange(n, dtype=torch.int32) for n in blocks]).to(device)
        self.src_off = _element_offsets(srcs, self.src_base).to(device)
        self.dst_off = _element_offsets(dsts, self.dst_base).to(device)
        self.numel = torch.tensor(numels, dtype=torch.int64, device=device)
        self.block = block

    def launch(self) -> None:
        _cast_copy_kernel[(self.block_tensor.numel(),)](
            self.src_base, self.dst_base, self.block_tensor, self.block_index, self.src_off,
            self.dst_off, self.numel, BLOCK=self.block, num_warps=8,
        )  # fmt: skip


def _element_offsets(tensors: list[torch.Tensor], base: torch.Tensor) -> torch.Tensor:
    size = base.element_size()
    offsets = [t.data_ptr() - base.data_ptr() for t in tensors]
    assert all(o % size == 0 for o in offsets)  # tensors of one dtype are aligned to their element
    return torch.tensor([o // size for o in offsets], dtype=torch.int64)


class CastCopyPlan:
    """dst.copy_(src) for every pair (contiguous tensors, equal numel), one launch per dtype pair.
    The sources and destinations must stay alive and in place while the plan is used."""

    def __init__(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], block: int = BLOCK) -> None:
        by_dtypes: dict[tuple, tuple[list, list]] = {}
        for dst, src in zip(dsts, srcs, strict=True):
            assert dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()
            if dst.numel():
                pair = by_dtypes.setdefault((dst.dtype, src.dtype), ([], []))
                pair[0].append(dst)
                pair[1].append(src)
        self.groups = [_Group(d, s, block) for d, s in by_dtypes.values()]

    def __call__(self) -> None:
        for group in self.groups:
            group.launch()


def cast_copy_triton(dsts: list[torch.Tensor], srcs: list[torch.Tensor], block: int = BLOCK) -> None:
    CastCopyPlan(dsts, srcs, block)()
