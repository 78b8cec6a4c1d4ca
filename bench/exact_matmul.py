"""The batch-invariant matmul (hybridflow/kernels/linear.py) at the row counts where the exact engine
and trainer spend their time: which tile shape comes nearest cuBLAS (past 64 rows the library loads
its tiles through TMA descriptors), and whether the K chunks run looped in one program or each in a
program of its own (the library splits where the loop's grid is smaller than the processor count).
Every variant's output is checked against the default's to the bit (neither the tile shape nor the
split may enter a row's result; one that changes the bits is reported, never taken as the best).

    PYTHONPATH=. python bench/exact_matmul.py --out matmul.json       # H100 / H200

Shapes: the 0.5B, 1.5B and 7B Qwen2.5 layers' projections (QKV, output, gate/up stacked, down, LM head),
bf16, at --rows rows (default 1024: a decode step of 1,024 sequences; 16384: a training or prefill
pack). Times are CUDA-graph replays of 20 calls (no launch gaps), median of 5, in microseconds."""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from hybridflow.kernels.linear import BLOCK_K, K_CHUNK, _tiles, linear

SHAPES = {  # (K, N) of each projection
    "0.5b": [(896, 1152), (896, 896), (896, 9728), (4864, 896), (896, 151936)],
    "1.5b": [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)],
    "7b": [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584), (3584, 151936)],
}
TILES = [(128, 128, 8, 3), (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3),
         (128, 64, 4, 4), (64, 128, 4, 4), (64, 256, 8, 3)]  # fmt: skip
# (up to 512 rows)
SMALL_TILES = [(32, 128, 4, 4), (32, 64, 4, 4), (16, 128, 4, 4), (16, 64, 4, 4), (16, 32, 4, 4)]


# (up to 64 rows, weight-read bound: deeper pipelines keep more of the weights in flight per program)
TAIL_TILES = [(16, 32, 4, 6), (16, 64, 4, 6), (16, 32, 4, 8), (16, 16, 4, 6), (32, 32, 4, 6), (64, 64, 4, 6)]


def tiles_for(rows: int) -> list[tuple[int, int, int, int]]:
    """The tiles tried at `rows` rows (each tile is a compile: the narrow ones where rows are few)."""
    if rows <= 64:
        return SMALL_TILES + TAIL_TILES + [(64, 64, 4, 4), (64, 128, 4, 4)]
    return TILES + (SMALL_TILES if rows <= 512 else [])


def graph_us(fn, calls: int = 20, repeats: int = 5) -> float:
    """Microseconds a call, from replays of a CUDA graph of `calls` calls (median of `repeats`)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(times)


def measure(shape: str, rows: int, k: int, n: int, default_tiles_only: bool = False) -> dict:
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    want = linear(x, w)
    entry = {"shape": shape, "rows": rows, "k": k, "n": n, "default_tiles": list(_tiles(rows, n, k)),
             "cublas_us": graph_us(lambda: F.linear(x, w)), "library_us": graph_us(lambda: linear(x, w)),
             "variants": {}}  # fmt: skip
    splits = (None, True, False) if k > K_CHUNK else (None,)  # (one chunk: nothing to split)
    for tiles in [_tiles(rows, n, k)] if default_tiles_only else tiles_for(rows):
        for split in splits:  # None: the library's rule for these tiles
            name = str(tiles) if split is None else f"{tiles} split {split}"
            try:
                same = torch.equal(linear(x, w, tiles=tiles, split=split), want)
                us = graph_us(lambda tiles=tiles, split=split: linear(x, w, tiles=tiles, split=split))
                entry["variants"][name] = {"us": round(us, 2), "same_bits": same}
            except Exception as e:  # noqa: BLE001 (a tile that does not fit: recorded)
                entry["variants"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    us, name = min((v["us"], name) for name, v in entry["variants"].items() if v.get("same_bits"))
    entry["best"] = {"variant": name, "us": us, "over_cublas": round(us / entry["cublas_us"], 3)}
    entry["library_over_cublas"] = round(entry["library_us"] / entry["cublas_us"], 3)
    return entry


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, action="append", help="repeatable (default 1024 and 16384)")
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument(
        "--default-tiles",
        action="store_true",
        help="only the library's tiles for each shape: its forms compared",
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "block_k": BLOCK_K, "k_chunk": K_CHUNK, "results": []}
    for rows in args.rows or [1024, 16384]:
        for shape in args.shapes.split(","):
            for k, n in SHAPES[shape]:
                report["results"].append(measure(shape, rows, k, n, args.default_tiles))
                print(json.dumps(report["results"][-1]), flush=True)
                with open(args.out, "w") as f:  # (whole so far: a run cut short keeps its rows)
                    json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
