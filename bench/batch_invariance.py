"""Which matmul gives a row the same bits whatever else is in the batch, and what it costs (on CUDA).

For bf16 activations x [M, K] and weights w [N, K] (the Qwen2.5 0.5B/1.5B/7B layers' shapes):
  1. cuBLAS (F.linear): is a row's result the same computed alone (M=1), among 64, and among 4,096?
  2. one Triton matmul (fp32 accumulation, the K range summed in BLOCK_K steps, in order) at several
     tile configs: is a row's result the same at every M, and across configs sharing BLOCK_K (BLOCK_M,
     BLOCK_N, warps, stages free)? If it is, a batch-invariant matmul can still pick its tile per M.
  3. time of each against F.linear at M = 1 .. 16,384.

    python bench/batch_invariance.py --out results.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {  # name: (K, N)
    "0.5b_qkv": (896, 1152),
    "0.5b_gate_up": (896, 9728),
    "0.5b_down": (4864, 896),
    "1.5b_gate_up": (1536, 17920),
    "1.5b_down": (8960, 1536),
    "7b_gate_up": (3584, 37888),
    "7b_down": (18944, 3584),
    "0.5b_lm_head": (896, 151936),
}


@triton.jit
def _matmul(
    x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * K + kk[None, :],
            mask=(rows[:, None] < M) & (kk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * K + kk[:, None],
            mask=(cols[None, :] < N) & (kk[:, None] < K),
            other=0.0,
        )
        acc = tl.dot(a, b, acc)
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def triton_linear(x, w, config):
    bm, bn, bk, warps, stages = config
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, out, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages
    )
    return out


CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (bm, bn, bk, w, s)
    for bm, bn, bk, w, s in itertools.product((16, 64, 128), (32, 128, 256), (64,), (4, 8), (3, 4))
    if not (bm == 128 and bn == 256 and s == 4)
] + [(64, 128, 128, 4, 3), (128, 128, 128, 8, 3), (16, 64, 128, 4, 3)]


def timed(fn, repeat=20):
    fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / repeat)
    return best  # ms


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--budget-s", type=float, default=400, help="stop after the shape that passes it")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shapes": {},
    }
    started = time.time()
    for name, (k, n) in SHAPES.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5
        x = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
        probe = x[:8]
        entry = {}
        # 1. cuBLAS: rows alone, in 64, in 4,096
        alone = torch.cat([F.linear(probe[i : i + 1], w) for i in range(8)])
        in64, in4096 = F.linear(x[:64], w)[:8], F.linear(x, w)[:8]
        entry["cublas_rows_equal"] = {
            "alone_vs_64": torch.equal(alone, in64),
            "alone_vs_4096": torch.equal(alone, in4096),
            "max_diff_alone_vs_4096": (alone.float() - in4096.float()).abs().max().item(),
        }
        # 2. Triton at every config: rows the same at every M, and the same across configs of one BLOCK_K
        by_bk: dict[int, torch.Tensor] = {}
        invariant, across = True, True
        broken = []
        for config in CONFIGS if not args.quick else CONFIGS[::6]:
            bk = config[2]
            try:
                outs = [triton_linear(x[:m], w, config)[:8] for m in (1, 8, 64, 4096)] + [
                    torch.cat([triton_linear(probe[i : i + 1], w, config) for i in range(8)])
                ]
            except Exception as e:  # a config this GPU cannot run (shared memory)
                broken.append(f"{config}: {type(e).__name__}")
                continue
            outs[0] = torch.cat([outs[0], outs[-1][1:]])
            same = all(torch.equal(outs[-1], o) for o in outs[:-1])
            invariant &= same
            ref = by_bk.setdefault(bk, outs[-1])
            if not torch.equal(ref, outs[-1]):
                across = False
                broken.append(
                    f"{config}: differs from the first config of BLOCK_K {bk} by "
                    f"{(ref.float() - outs[-1].float()).abs().max().item():.3g}"
                )
        entry["triton_each_config_batch_invariant"] = invariant
        entry["triton_configs_of_one_block_k_agree"] = across
        entry["notes"] = broken[:20]
        entry["triton_vs_cublas_max_diff"] = (by_bk[64].float() - in4096.float()).abs().max().item()
        # 3. time: F.linear against the best Triton config at each M
        times = {}
        for m in (1, 16, 64, 256, 1024, 4096, 16384) if not args.quick else (1, 4096):
            xm = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_cublas = timed(lambda xm=xm, w=w: F.linear(xm, w))
            best = (float("inf"), None)
            for config in CONFIGS if not args.quick else CONFIGS[::6]:
                if config[2] != 64:
                    continue
                try:
                    t = timed(lambda xm=xm, w=w, c=config: triton_linear(xm, w, c), repeat=10)
                except Exception:
                    continue
                best = min(best, (t, config))
            times[m] = {
                "cublas_ms": round(t_cublas, 4),
                "triton_best_ms": round(best[0], 4),
                "config": best[1],
                "ratio": round(best[0] / t_cublas, 3),
            }
        entry["times"] = times
        report["shapes"][name] = entry
        print(name, json.dumps(entry), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        if time.time() - started > args.budget_s:
            report["stopped_early"] = True
            break
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
