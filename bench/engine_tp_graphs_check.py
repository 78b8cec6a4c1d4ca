"""CUDA graphs of a tensor-parallel engine (rollout.tensor_parallel_size): its decode steps replay as graphs
with the TP plan's all-reduces and the logits' gather inside. One GPU cannot hold two NCCL ranks, so the
engine splits over a group of one: every collective still goes through DTensor and NCCL and is captured,
and each capture's first replay is checked against its eager warm-up (the check that stops every rank of a
real group when a collective is missing: tests/cpu/test_engine_tensor_parallel.py). Reports, for the split
engine eager and with graphs, and a whole engine (its fused layers): decode tokens/s, the collectives the
host issued while generating (a dispatch mode counts the c10d ops: with graphs, those of the captures and of the ranks' per-step
agreement only), and the sampled tokens' log-prob gap to the trainer's forward.

    PYTHONPATH=. python bench/engine_tp_graphs_check.py --shape 0.5b --prompts 64
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
from decode_parity import gap_to_trainer  # bench/ is the script's own directory
from rollout import SHAPES, VOCAB, random_model
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from hybridflow.controller.worker_group import free_address
from hybridflow.engine import Engine, EngineConfig
from hybridflow.rollout.sampling import SamplingParams


class Collectives(TorchDispatchMode):
    """The c10d collectives dispatched from the host under it, by name (a graph's replay dispatches none)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.name()
        if "c10d" in name and "wait_tensor" not in name:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def measure(model, mesh, prompts, params, graphs: bool, response: int) -> dict:
    config = EngineConfig(
        max_batch_sequences=256,
        max_context_tokens=max(map(len, prompts)) + response + 1,
        gpu_memory_utilization=0.3,
        cuda_graphs=graphs,
        share_weights=False,
    )
    engine = Engine(model, eos_token_ids=[], config=config, tp_mesh=mesh)
    # warm-up: the batch's graphs captured before the clock starts (all responses run to the end)
    engine.generate(prompts, SamplingParams(n=params.n, max_tokens=16, seed=1))
    torch.cuda.synchronize()
    start = time.perf_counter()
    with Collectives() as comm:
        out = engine.generate(prompts, params)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in out)
    result = {
        "split": mesh is not None,
        "cuda_graphs": graphs,
        "fused_layers": engine.runner.fused is not None,
        "decode_graphs_captured": len(engine.runner.graphs) + len(engine.runner.step_graphs),
        "tokens_per_s": round(tokens / seconds),
        "steps": engine.stats.get("steps"),
        "host_collectives": comm.counts,
        "logprob_gap_vs_trainer": gap_to_trainer(model, prompts, out[:64]),
    }
    engine.sleep()
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--response", type=int, default=256)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("CUDA graphs need a GPU")
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_address()[1])}
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",))
        model = random_model(args.shape, torch.device("cuda"), torch.bfloat16)
        rng = random.Random(0)
        prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(64, 256))] for _ in range(args.prompts)]
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.response, seed=0)
        runs = [
            measure(model, mesh, prompts, params, graphs=False, response=args.response),
            measure(model, mesh, prompts, params, graphs=True, response=args.response),
            measure(model, None, prompts, params, graphs=True, response=args.response),
        ]
        print(
            json.dumps({"shape": args.shape, "device": torch.cuda.get_device_name(), "runs": runs}, indent=1)
        )
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
