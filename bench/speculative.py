"""Speculative decoding from the run's own history (#62) against the plain engine, on this CPU or a
GPU: a model's responses to GSM8K prompts (verl's instruction, chat template), `--n` samples each at
temperature 1 up to `--tokens` tokens (EOS stops them), in epochs as training meets them: epoch 1
with nothing on record, epoch 2 (another seed) drafting from epoch 1's responses too. And a control
with nothing to reuse: prompts of random tokens, one epoch. Each engine is made fresh for its
workload; plain and speculative alternate `--repeats` times. With fp32 on a CPU, or with `--exact`
(the batch-invariant kernels) on a GPU, the two produce the same tokens; with bf16's ordinary kernels a
verifying step's matmuls see more rows than a plain step's and may round differently, so a sampled
sequence may part from the plain one where two tokens were nearly tied (`same_sequences` counts them).

    PYTHONPATH=. python bench/speculative.py --data ../shared/data/gsm8k --out spec.json
    (GPU: --model /tmp/qwen --device cuda --prompts 32 --tokens 512)
    # a random-weight shape (random prompts only), greedy: a quick check of the verifying step on a GPU
    PYTHONPATH=.:bench python bench/speculative.py --shape 0.5b --device cuda --temperature 0 \
        --workloads random_prompts,random_one_sequence --out check.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.drafter import SpeculativeConfig
from hybridflow.models import load_causal_lm, stop_token_ids
from hybridflow.rollout.sampling import SamplingParams

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_prompts(tokenizer, data: Path, count: int) -> list[list[int]]:
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()[:count]]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )  # fmt: skip
        for row in rows
    ]


def run_epochs(model, eos, prompts, params, epochs, k, args) -> dict:
    """A fresh engine, `epochs` calls of the prompts (seed + epoch each) -> seconds and tokens per call."""
    config = EngineConfig(
        max_context_tokens=args.context,
        max_batch_sequences=max(
            len(prompts) * params.n, 2
        ),  # (on a CPU the KV pool holds them all at full context)
        speculative=SpeculativeConfig(
            num_speculative_tokens=k, max_batch_sequences=args.max_batch, adaptive=not args.always
        ),
        exact_logprobs=args.exact,
    )
    engine = Engine(model, eos_token_ids=eos, config=config)
    out = []
    for epoch in range(epochs):
        p = replace(params, seed=params.seed + epoch)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        gens = engine.generate(prompts, p)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        out.append(
            {
                "seconds": seconds,
                "tokens": sum(len(g.token_ids) for g in gens),
                "outputs": [g.token_ids for g in gens],
                **{k: v for k, v in engine.stats.items() if k.startswith("speculative_")},
            }  # fmt: skip
        )
    return out


def vllm_epochs(args, eos, prompts, params, epochs) -> list[dict]:
    """The same epochs through vLLM (`--backend vllm`): one engine for them all (vLLM's start is long;
    its suffix method learns across requests as the history here does), each epoch once."""
    from hybridflow.rollout.vllm import VLLMBackend

    method = args.vllm_method
    spec = None
    if method != "plain":
        spec = {"method": method, "num_speculative_tokens": args.k}
        if method == "ngram":
            spec |= {"prompt_lookup_max": 4, "prompt_lookup_min": 2}
    model_dir = args.model
    if model_dir == "default":  # the embedded model as the transformers directory kept of it
        from hybridflow.models.default import default_model_dir

        model_dir = str(default_model_dir())
    backend = VLLMBackend(
        model_dir, eos_token_ids=eos, max_model_len=args.context, speculative_config=spec, log_stats=True
    )
    backend.generate([[1000, 1001, 1002]], replace(params, n=1, max_tokens=8))  # warm-up
    cuda = torch.cuda.is_available()
    out = []
    for epoch in range(epochs):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        gens = backend.generate(prompts, replace(params, seed=params.seed + epoch))
        if cuda:
            torch.cuda.synchronize()
        out.append({"seconds": time.perf_counter() - start, "tokens": sum(len(g.token_ids) for g in gens)})
    metrics = backend.llm.get_metrics()
    out[-1]["vllm_spec_metrics"] = {
        m.name: getattr(m, "value", getattr(m, "values", None)) for m in metrics if "spec_decode" in m.name
    }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--shape", default=None, help="random weights of bench/rollout.py's shape (no tokenizer)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--exact", action="store_true", help="rollout.exact_logprobs' kernels (CUDA)")
    ap.add_argument(
        "--always", action="store_true", help="speculate whenever a draft exists (adaptive=False: no gate)"
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", type=Path, default=Path("../shared/data/gsm8k"))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="speculate while at most this many run (default: by device)",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="gsm8k,random_prompts,gsm8k_one_sequence,random_one_sequence")
    ap.add_argument("--backend", choices=["native", "vllm"], default="native")
    ap.add_argument(
        "--vllm-method",
        choices=["plain", "ngram", "suffix"],
        default="plain",
        help="--backend vllm: no speculation, vLLM's n-gram prompt lookup, or its suffix decoding "
        "(a suffix tree over earlier outputs too; needs arctic-inference)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.backend == "vllm" and (args.shape or args.exact or args.always):
        raise SystemExit(
            "--backend vllm runs vLLM's own engine on a model directory (--model): "
            "--shape, --exact and --always are the native engine's"
        )
    torch.manual_seed(0)
    if args.shape:
        from rollout import random_model

        model, eos = random_model(args.shape, args.device, torch.float32), []
    else:
        model, tokenizer = load_causal_lm(args.model, impl="native")
        model = model.to(args.device) if args.backend == "native" else model  # (vLLM loads its own)
        eos = stop_token_ids(model, tokenizer)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.tokens, n=args.n, seed=1)
    rng = random.Random(0)
    gsm8k = (lambda count: gsm8k_prompts(tokenizer, args.data, count)) if not args.shape else None
    workloads = {
        "gsm8k": (lambda: gsm8k(args.prompts), 2, args.n),
        "random_prompts": (
            lambda: [[rng.randrange(1000, 30000) for _ in range(60)] for _ in range(args.prompts)],
            1,
            args.n,
        ),
        # the tail alone: one sequence, its second epoch drafting from its first
        "gsm8k_one_sequence": (lambda: gsm8k(1), 2, 1),
        "random_one_sequence": (lambda: [[rng.randrange(1000, 30000) for _ in range(60)]], 1, 1),
    }
    report = {"model": args.model, "device": args.device, "args": {k: str(v) for k, v in vars(args).items()},
              "date": time.strftime("%Y-%m-%d"), "workloads": {}}  # fmt: skip
    if args.backend == "vllm":
        names = args.workloads.split(",")
        # one process per workload: a process holds one vLLM engine (its GPU memory, its allocator)
        if len(names) > 1:
            for name in names:
                part = f"{args.out}.{name}"
                argv = [*sys.argv[1:], "--workloads", name, "--out", part]  # (the last of each counts)
                subprocess.run([sys.executable, __file__, *argv], check=True)
                report["workloads"] |= json.loads(Path(part).read_text())["workloads"]
                Path(part).unlink()
                Path(args.out).write_text(json.dumps(report, indent=1))
            return
        make_prompts, epochs, n = workloads[names[0]]
        runs = vllm_epochs(args, eos, make_prompts(), replace(params, n=n), epochs)
        report["workloads"][names[0]] = {
            f"epoch_{i + 1}": r | {"tokens_per_s": r["tokens"] / r["seconds"]} for i, r in enumerate(runs)
        }
        print(names[0], json.dumps(report["workloads"][names[0]]), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        return
    # the process's first generation pays its one-time costs (CUDA context, kernels' first launches)
    run_epochs(model, eos, [[1000, 1001, 1002]], replace(params, n=1, max_tokens=8), 1, args.k, args)
    for name in args.workloads.split(","):
        make_prompts, epochs, n = workloads[name]
        prompts = make_prompts()
        runs = {"plain": [], "speculative": []}
        for _ in range(args.repeats):
            for label, k in (("plain", 0), ("speculative", args.k)):
                runs[label].append(run_epochs(model, eos, prompts, replace(params, n=n), epochs, k, args))
        pairs = [
            (a, b)
            for x, y in zip(runs["plain"], runs["speculative"]) for e, f in zip(x, y)
            for a, b in zip(e["outputs"], f["outputs"])
        ]  # fmt: skip
        entry = {"same_sequences": f"{sum(a == b for a, b in pairs)} of {len(pairs)}"}
        for epoch in range(epochs):
            row = {}
            for label, results in runs.items():
                seconds = [r[epoch]["seconds"] for r in results]
                tokens = results[0][epoch]["tokens"]
                row[label] = {
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": tokens / statistics.median(seconds),
                }
                row[label] |= {k: v for k, v in results[0][epoch].items() if k.startswith("speculative_")}
            row["speedup"] = row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            entry[f"epoch_{epoch + 1}"] = row
        report["workloads"][name] = entry
        print(name, json.dumps(entry), flush=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
