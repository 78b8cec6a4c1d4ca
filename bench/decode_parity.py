"""The fused decode step against the trainer's modules on the GPU (issue #28): the same random-weight
Qwen2.5 shape decoded by the engine with `fused_decode` on and off, greedy and sampled; reports how
many sequences come out token for token the same, and each path's log-prob gap to the trainer's
forward (fp32 master weights, autocast) over the sequences it sampled.

    PYTHONPATH=. python bench/decode_parity.py --shape 0.5b --master fp32     # H200
"""

from __future__ import annotations

import argparse
import json
import random
import sys

import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.roles.forward import packed_response_logprobs
from hybridflow.rollout.sampling import SamplingParams

sys.path.insert(0, "bench")
from rollout import VOCAB, _fp32_master, random_model  # noqa: E402


def gap_to_trainer(master, prompts, out) -> dict:
    with torch.no_grad():
        trainer, _ = packed_response_logprobs(
            master, [prompts[g.prompt_index] for g in out], [g.token_ids for g in out],
            device=torch.device("cuda"), compute_dtype="auto",
        )  # fmt: skip
    gaps = torch.cat(
        [
            (trainer[i, : len(g.token_ids)].cpu() - torch.tensor(g.unscaled_logprobs)).abs()
            for i, g in enumerate(out)
        ]
    )
    return {"mean": round(gaps.mean().item(), 5), "max": round(gaps.max().item(), 4)}


def graph_transitions(model, prompts) -> dict:
    """The fused step with CUDA graphs against the same step run eagerly (same kernels, so the same
    tokens bit for bit) through what changes the captured graphs: a first run without stops, then
    one with 506 stop ids (the stop buffer grows: every graph is captured again), requests of mixed
    temperatures in one batch and one with top-k (the draw outside the graph), sleep and wake."""
    stops = random.Random(1).sample(range(VOCAB), VOCAB // 300)
    phases = [
        ("no stops", [SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=1)]),
        ("506 stops", [SamplingParams(n=2, temperature=1.0, max_tokens=300, seed=2, stop_token_ids=stops)]),
        ("mixed temperatures", [SamplingParams(temperature=0.7, max_tokens=40, seed=3),
                                SamplingParams(temperature=0.0, max_tokens=40)]),
        ("top-k", [SamplingParams(temperature=1.0, top_k=50, max_tokens=40, seed=4)]),
        ("after sleep and wake", [SamplingParams(n=2, temperature=0.7, max_tokens=40, seed=5)]),
    ]  # fmt: skip
    results: dict[str, list] = {}
    for graphs in (True, False):
        config = EngineConfig(max_context_tokens=512, page_size=64, gpu_memory_utilization=0.2,
                              cuda_graphs=graphs, max_batch_sequences=96)  # fmt: skip
        engine = Engine(model, eos_token_ids=[], config=config, device=torch.device("cuda"))
        runs = []
        for name, param_sets in phases:
            if name == "after sleep and wake":
                engine.sleep()
                engine.wake()
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{name}-{i}", prompt, param_sets[i % len(param_sets)])
            outs = []
            while engine.has_unfinished_requests:
                outs += engine.step()
            runs.append(sorted((o.request_id, o.sample, tuple(o.token_ids)) for o in outs))
        results[graphs] = runs
    report = {}
    for (name, _), with_graphs, eager in zip(phases, results[True], results[False]):
        report[name] = "identical" if with_graphs == eager else "DIFFERENT"
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--master", choices=["bf16", "fp32"], default="fp32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    device = torch.device("cuda")
    model = random_model(args.shape, device, torch.float32 if args.master == "fp32" else torch.bfloat16)
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(16, 200))] for _ in range(args.prompts)]
    report = {"shape": args.shape, "master": args.master}
    engines = {}
    for fused in (True, False):
        config = EngineConfig(
            max_context_tokens=512, page_size=64, gpu_memory_utilization=0.2, fused_decode=fused
        )
        engines[fused] = Engine(model, eos_token_ids=[], config=config, device=device)
    master = _fp32_master(engines[False].model)
    for name, params in {
        "greedy": SamplingParams(temperature=0.0, max_tokens=args.tokens),
        "t=1": SamplingParams(n=2, temperature=1.0, max_tokens=args.tokens, seed=3),
        "t=0.7": SamplingParams(n=2, temperature=0.7, max_tokens=args.tokens, seed=3),
    }.items():
        outs = {fused: engine.generate(prompts, params) for fused, engine in engines.items()}
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs[True], outs[False]))
        first = [
            next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
            for a, b in zip(outs[True], outs[False])
        ]
        report[name] = {
            "identical_sequences": f"{same}/{len(first)}",
            "mean_first_divergence": sum(first) / len(first),
            "gap_fused": gap_to_trainer(master, prompts, outs[True]),
            "gap_unfused": gap_to_trainer(master, prompts, outs[False]),
        }
        print(json.dumps({name: report[name]}), flush=True)
    report["graphs_vs_eager"] = graph_transitions(model, prompts)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
