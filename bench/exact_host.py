"""The host's cost of each exact (batch-invariant) op against its ordinary counterpart: microseconds of
Python and launch a call, on inputs small enough that the GPU keeps up (so a call's wall time is the
host's). An exact update on a small step waits on the host (docs/benchmarks.md: 0.271 s of kernels in
a 0.916 s update); this says which part of a call the host spends it on.

    PYTHONPATH=. python bench/exact_host.py --out host.json     # H100 / H200

Rows (0.5B shape, bf16, ROWS rows, weights fp32 under bf16 autocast as the trainer holds them where
marked): a bare Triton launch (one pointer argument: the floor), cuBLAS through F.linear, the exact
matmul's launch through pointers (<= 64 rows) and through TMA descriptors (past 64), the same launch
with its descriptors made once (what a descriptor costs), the trainer's exact_linear (autograd
function, the weight's cast) against F.linear under autocast, and the RMSNorm, SiLU-mul and RoPE ops.
Each: the median of 5 rounds of 200 calls, after a warm-up (compiles)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hybridflow.kernels.launch import OPTIONS
from hybridflow.kernels.linear import BLOCK_K, K_CHUNK, _tiles, _tma_kernel, exact_linear, linear
from hybridflow.kernels.rms_norm import exact_rms_norm
from hybridflow.kernels.rope import exact_rope_qk
from hybridflow.kernels.swiglu import exact_silu_mul


@triton.jit
def _touch_kernel(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


def host_us(fn, calls: int = 200, rounds: int = 5) -> float:
    """Microseconds of host time a call (the GPU trails: nothing waits on it inside a round)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - began) * 1e6 / calls)
        torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--out-features", type=int, default=896)
    args = ap.parse_args()
    torch.manual_seed(0)
    k, n = args.hidden, args.out_features
    cuda = torch.device("cuda")
    scratch = torch.zeros(1024, device=cuda)
    w16 = torch.randn(n, k, device=cuda, dtype=torch.bfloat16) * 0.02
    w32 = w16.float().requires_grad_()
    norm_w = torch.ones(k, device=cuda, requires_grad=True)
    rows = {"bare Triton launch (one pointer)": host_us(lambda: _touch_kernel[(1,)](scratch))}
    for m in (64, 256):
        x = torch.randn(m, k, device=cuda, dtype=torch.bfloat16)
        block_m, block_n, warps, stages = _tiles(m, n, k)
        rows[f"{m} rows: F.linear (cuBLAS)"] = host_us(lambda x=x: F.linear(x, w16))
        rows[f"{m} rows: linear() ({'TMA' if m > 64 else 'pointer'} form)"] = host_us(
            lambda x=x: linear(x, w16)
        )
        if m > 64:  # the TMA launch alone, its descriptors made each call and made once
            y = torch.empty(m, n, device=cuda, dtype=torch.bfloat16)
            grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
            tile = dict(HAS_BIAS=False, HAS_RES=False, ROUND="bfloat16", BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, K_CHUNK=K_CHUNK,
                        PRECISION="tf32", num_warps=warps, num_stages=stages, **OPTIONS)  # fmt: skip
            made = (
                TensorDescriptor.from_tensor(x, [block_m, BLOCK_K]),
                TensorDescriptor.from_tensor(w16, [block_n, BLOCK_K]),
            )

            def fresh(x=x, y=y, m=m, grid=grid, tile=tile, block_m=block_m, block_n=block_n):
                xd = TensorDescriptor.from_tensor(x, [block_m, BLOCK_K])
                wd = TensorDescriptor.from_tensor(w16, [block_n, BLOCK_K])
                _tma_kernel[grid](xd, wd, y, y, y, m, n, k, y.stride(0), **tile)

            rows[f"{m} rows: TMA launch, descriptors made each call"] = host_us(fresh)
            rows[f"{m} rows: TMA launch, descriptors made once"] = host_us(
                lambda y=y, m=m, grid=grid, tile=tile, made=made: _tma_kernel[grid](
                    *made, y, y, y, m, n, k, y.stride(0), **tile
                )
            )
        xa = x.float().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            rows[f"{m} rows: exact_linear, fp32 weight under autocast (forward)"] = host_us(
                lambda xa=xa: exact_linear(xa, w32, None)
            )
            rows[f"{m} rows: F.linear, fp32 weight under autocast (forward)"] = host_us(
                lambda xa=xa: F.linear(xa, w32)
            )
        rows[f"{m} rows: exact_rms_norm (forward)"] = host_us(lambda xa=xa: exact_rms_norm(xa, norm_w, 1e-6))
        gate = torch.randn(m, 4864, device=cuda, dtype=torch.bfloat16)
        rows[f"{m} rows: exact_silu_mul (forward)"] = host_us(lambda gate=gate: exact_silu_mul(gate, gate))
        rows[f"{m} rows: F.silu(gate) * up"] = host_us(lambda gate=gate: F.silu(gate) * gate)
        q = torch.randn(m, 14, 64, device=cuda, dtype=torch.bfloat16)
        kk = torch.randn(m, 2, 64, device=cuda, dtype=torch.bfloat16)
        cos = torch.randn(m, 64, device=cuda)
        rows[f"{m} rows: exact_rope_qk (forward)"] = host_us(
            lambda q=q, kk=kk, cos=cos: exact_rope_qk(q, kk, cos, cos, torch.bfloat16)
        )
    report = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
              "shape": {"k": k, "n": n}, "host_us_per_call": rows}  # fmt: skip
    print(json.dumps(report, indent=1))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
