"""The small-batch matmuls of a decode step (engine/triton_gemv.py) against what they replace, on a GPU:
for each projection of the 0.5B/1.5B/7B Qwen2.5 layers at 1, 4 and 16 rows, cuBLAS (F.linear) with the
separate norm or SwiGLU kernel before it, against the fused kernel in several tile shapes. Each is
timed as CUDA graph replays (the decode step is one), so launch gaps count as they do there. Reports
microseconds, the weight-read bandwidth reached, and the largest difference from the cuBLAS path.

    PYTHONPATH=.:bench python bench/gemv_tiles.py --out gemv.json
"""

# ruff: noqa: B023 (each closure is timed at once, inside its loop iteration)
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from rollout import SHAPES  # bench/ is the script's own directory
from triton.testing import do_bench_cudagraph

from hybridflow.engine.triton_gemv import _tiles, gemv
from hybridflow.engine.triton_layer import rms_norm, silu_mul

TILES = [(16, 64, 4, 4), (16, 128, 4, 4), (16, 256, 4, 4), (16, 512, 4, 3), (32, 128, 4, 4), (32, 256, 4, 4),
         (64, 128, 4, 3), (16, 256, 8, 4), (16, 128, 2, 6)]  # fmt: skip


def cases(shape: dict, rows: int, dev):
    """(name, reference fn, fused fn(tiles), weight bytes) for one layer's four projections."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    bf = torch.bfloat16
    x = torch.randn(rows, h, device=dev, dtype=torch.float32)
    res = torch.randn(rows, h, device=dev, dtype=bf)
    norm_w = torch.rand(h, device=dev)
    x_out = torch.empty_like(x)
    normed = torch.empty(rows, h, device=dev, dtype=bf)
    qkv_w = torch.randn((heads + 2 * kv) * d, h, device=dev, dtype=bf) * 0.02
    qkv_b = torch.randn(qkv_w.shape[0], device=dev, dtype=bf)
    o_w = torch.randn(h, heads * d, device=dev, dtype=bf) * 0.02
    attn = torch.randn(rows, heads * d, device=dev, dtype=bf)
    gu_w = torch.randn(2 * i, h, device=dev, dtype=bf) * 0.02
    down_w = torch.randn(h, i, device=dev, dtype=bf) * 0.02
    gu = torch.randn(rows, 2 * i, device=dev, dtype=bf)
    act = torch.empty(rows, i, device=dev, dtype=bf)
    gate, up = gu.split([i, i], 1)

    def norm_ref(w, b):
        x2 = x.clone()  # the norm kernel adds the residual in place (the fused one writes x_out)

        def run():
            rms_norm(x2, norm_w, 1e-6, normed, residual=res)
            return F.linear(normed, w, b)

        return run

    def norm_fused(w, b):
        return lambda tiles: gemv(x, w, b, norm_weight=norm_w, residual=res, x_out=x_out, tiles=tiles)

    def swiglu_ref():
        silu_mul(gate, up, act)
        return F.linear(act, down_w)

    return [
        ("qkv (norm + bias)", norm_ref(qkv_w, qkv_b), norm_fused(qkv_w, qkv_b), qkv_w.numel() * 2),
        ("o", lambda: F.linear(attn, o_w), lambda tiles: gemv(attn, o_w, tiles=tiles), o_w.numel() * 2),
        ("gate_up (norm)", norm_ref(gu_w, None), norm_fused(gu_w, None), gu_w.numel() * 2),
        (
            "down (swiglu)",
            swiglu_ref,
            lambda tiles: gemv(gate, down_w, up=up, tiles=tiles),
            down_w.numel() * 2,
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="0.5b,1.5b,7b")
    args = ap.parse_args()
    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(), "results": []}
    for shape_name in args.shapes.split(","):
        for rows in (1, 4, 16):
            torch.manual_seed(0)
            for name, ref, fused, weight_bytes in cases(SHAPES[shape_name], rows, dev):
                expected = ref()
                row = {"shape": shape_name, "rows": rows, "matmul": name, "weight_mib": round(weight_bytes / 2**20, 2),
                       "cublas_path_us": round(1e3 * do_bench_cudagraph(ref, rep=50), 2), "tiles": {}}  # fmt: skip
                n, k = expected.shape[1], weight_bytes // 2 // expected.shape[1]
                for tiles in TILES:
                    try:
                        got = fused(tiles)
                        err = (got.float() - expected.float()).abs().max().item()
                        us = 1e3 * do_bench_cudagraph(lambda: fused(tiles), rep=50)
                        row["tiles"][str(tiles)] = {"us": round(us, 2), "tb_per_s": round(weight_bytes / us / 1e6, 2),
                                                    "max_abs_diff": err}  # fmt: skip
                    except Exception as e:  # a tile shape the compiler refuses (shared memory)
                        row["tiles"][str(tiles)] = {"error": str(e)[:200]}
                timed = {t: v["us"] for t, v in row["tiles"].items() if "us" in v}
                row["best"] = min(timed, key=timed.get)
                row["default"] = str(_tiles(n, k))
                row["default_us"] = timed.get(row["default"])
                report["results"].append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
