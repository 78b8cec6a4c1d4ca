"""Tensor-parallel MoE layers (parallel/tensor_moe.py) on one GPU: each rank runs the grouped GEMM on the
rows of its own experts and leaves the other ranks' rows uncomputed. One GPU cannot hold two ranks, so
two are simulated on a group of one: two halves of a block's experts, each with its own rows, summed,
against the whole block; outputs, the input's and the routing weights' gradients (bf16, CUDA: the
grouped-GEMM path; elsewhere fp32 and the per-expert loop).

    PYTHONPATH=. python bench/moe_tp_check.py
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hybridflow.controller.worker_group import free_address
from hybridflow.models.native.moe import MoEConfig, SparseMoE
from hybridflow.parallel.tensor_moe import TensorParallelMoE

EXPERTS, HIDDEN, INTERMEDIATE, TOKENS, TOP_K = 8, 256, 512, 1000, 2


def _half(whole: SparseMoE, mesh, rank: int) -> TensorParallelMoE:
    """Rank `rank` of two: the block with experts rank*E/2 .. (rank+1)*E/2 - 1."""
    half = TensorParallelMoE(copy.deepcopy(whole), mesh)  # on a group of one: every expert, then cut
    mine = EXPERTS // 2
    half.local_experts, half.first_expert = mine, rank * mine
    for name in ("gate_up_proj", "down_proj"):
        part = getattr(whole.experts, name).detach()[rank * mine : (rank + 1) * mine].clone()
        setattr(half.experts, name, nn.Parameter(DTensor.from_local(part, mesh, [Shard(0)], run_check=False)))
    return half


def main() -> None:
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_address()[1])}
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1,), mesh_dim_names=("tp",))
        torch.manual_seed(0)
        config = MoEConfig(EXPERTS, TOP_K, INTERMEDIATE, norm_topk_prob=True, sparse_layers=(0,))
        whole = SparseMoE(HIDDEN, config).to(device=device, dtype=dtype)
        for p in whole.parameters():
            nn.init.normal_(p, std=0.05)
        x = torch.randn(TOKENS, HIDDEN, device=device, dtype=dtype, requires_grad=True)
        weights, chosen = whole.route(x.detach())  # [N, k] each
        weights = weights.detach().requires_grad_(True)
        expected = whole.mix(x, weights, chosen)  # [N, H]
        grad = torch.randn_like(expected)
        expected.backward(grad)
        expected_dx, expected_dw = x.grad.clone(), weights.grad.clone()
        x.grad = weights.grad = None
        summed = sum(_half(whole, mesh, rank).mix(x, weights, chosen) for rank in range(2))
        summed.backward(grad)
        with torch.no_grad():
            for what, got, want in (
                ("output", summed, expected),
                ("input gradient", x.grad, expected_dx),
                ("routing weights' gradient", weights.grad, expected_dw),
            ):
                print(f"{what}: max difference {float((got - want).abs().max())} of {float(want.abs().max())}, "
                      f"finite {bool(torch.isfinite(got).all())}")  # fmt: skip
        print(f"{device}, {dtype}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
