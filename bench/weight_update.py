"""The engine's weight update (fp32 trainer parameters cast into its bf16 weights) against a plain
device copy of the same bytes, in the same run.

    PYTHONPATH=. python bench/weight_update.py         # H200: Qwen2.5 0.5B, 1.5B, 7B shapes

The trainer side is an fp32 model (as our trainer keeps its master weights); the engine side is
`engine_model` of it (bf16 matmul weights, fp32 embedding and norms, a bf16 copy of a tied LM head),
updated through the same `WeightUpdater` that `Engine.update_weights` uses: wall time of one
synchronised call, host work included, mean of 10. Also sweeps the copy kernel's settings and times
torch's per-tensor `copy_` loop. Prints one JSON object per shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from hybridflow.engine.triton_copy import CastCopyPlan
from hybridflow.engine.weights import WeightUpdater, engine_model, weight_targets

sys.path.insert(0, str(Path(__file__).parent))
from rollout import random_model  # noqa: E402

SETTINGS = [(4096, 8, 8), (4096, 4, 8), (8192, 4, 8), (2048, 16, 4), (8192, 1, 8), (1024, 32, 4)]


def _wall(fn, repeat: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    total = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        total += time.perf_counter() - start
    return total / repeat


def _measure(shape: str) -> dict:
    trainer = random_model(shape, "cuda", torch.float32)
    engine = engine_model(trainer, torch.device("cuda"), torch.bfloat16)
    targets = weight_targets(engine)
    update = WeightUpdater(targets)
    params = list(trainer.named_parameters())
    written = update(params)
    pairs = [(dst, src) for name, src in params for dst in targets[name]]
    exact = all(torch.equal(dst, src.to(dst.dtype)) for dst, src in pairs)
    seconds = _wall(lambda: update(params))
    src = torch.empty(written, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    memcpy = _wall(lambda: dst.copy_(src))
    per_tensor = _wall(lambda: [d.copy_(s) for d, s in pairs])
    sweep = {}
    for block, iters, warps in SETTINGS:
        plan = CastCopyPlan(
            [d for d, _ in pairs], [s for _, s in pairs], block=block, iters=iters, warps=warps
        )
        sweep[f"block={block} iters={iters} warps={warps}"] = _wall(plan) / memcpy
    return {
        "shape": shape,
        "tensors": len(pairs),
        "bytes_written": written,
        "update_weights_ms": seconds * 1e3,
        "memcpy_ms": memcpy * 1e3,
        "ratio": seconds / memcpy,
        "equal_to_torch_cast": exact,
        "per_tensor_copy_ratio": per_tensor / memcpy,
        "plan_only_ratio_by_setting": sweep,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "7b"])
    args = parser.parse_args()
    for shape in args.shapes:
        print(json.dumps(_measure(shape)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
