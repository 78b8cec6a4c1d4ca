"""The demo's rollout on this CPU (issue #28): the embedded SmolLM2-135M-Instruct in fp32, the
built-in arithmetic task's chat prompts (~45 tokens), 4 prompts x 8 samples, responses forced to
`--tokens` (no EOS), greedy and temperature 1: the native engine against the `hf` backend
(transformers generate), alternating, `--repeats` times each; medians of tok/s. `--unpacked` adds
the engine on the trainer's modules as they are (`fused_decode=False`: MKL's matmuls, no oneDNN
packed weights) to the same rotation.

    PYTHONPATH=. python bench/cpu_rollout.py --tokens 64 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.models import load_causal_lm
from hybridflow.rollout.hf import HFBackend
from hybridflow.rollout.sampling import SamplingParams


def demo_prompts(tokenizer, count: int) -> list[list[int]]:
    """The demo recipe's problems (one-digit + and -), chat-templated as training feeds them."""
    from hybridflow.data.tasks.arithmetic import ArithmeticSpec, make_rows

    spec = ArithmeticSpec(max_digits=1, instruction="Answer with just the number.")
    rows = make_rows(count, seed=0, split="train", spec=spec)
    return [
        tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for row in rows
    ]


def tokens_per_s(backend, prompts, params) -> float:
    start = time.perf_counter()
    out = backend.generate(prompts, params)
    return sum(len(g.token_ids) for g in out) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--unpacked", action="store_true", help="also the engine without oneDNN's packed matmuls")
    args = ap.parse_args()
    native, tokenizer = load_causal_lm("default", impl="native")
    hf, _ = load_causal_lm("default", impl="hf")
    prompts = demo_prompts(tokenizer, args.prompts)
    never = [native.config.vocab_size + 1]  # forced lengths: no token stops a sequence
    config = EngineConfig(max_context_tokens=512, page_size=16)
    engine = Engine(native, eos_token_ids=never, config=config)
    backends = {"native": engine, "hf": HFBackend(hf, pad_token_id=0, eos_token_ids=never)}
    if args.unpacked:
        backends["native_unpacked"] = Engine(
            native, eos_token_ids=never, config=replace(config, fused_decode=False)
        )
    report = {"threads": torch.get_num_threads(), "prompt_tokens": [len(p) for p in prompts],
              "sequences": args.prompts * args.n, "tokens": args.tokens}  # fmt: skip
    for name, temperature in (("greedy", 0.0), ("t=1", 1.0)):
        params = SamplingParams(n=args.n, temperature=temperature, max_tokens=args.tokens, seed=0)
        for backend in backends.values():  # warm-up
            backend.generate(prompts[:1], SamplingParams(n=2, temperature=temperature, max_tokens=4))
        runs: dict[str, list[float]] = {k: [] for k in backends}
        for _ in range(args.repeats):
            for key, backend in backends.items():
                runs[key].append(tokens_per_s(backend, prompts, params))
        medians = {k: statistics.median(v) for k, v in runs.items()}
        report[name] = {
            "tokens_per_s": {k: round(v, 1) for k, v in medians.items()},
            "runs": {k: [round(x, 1) for x in v] for k, v in runs.items()},
            "native_over_hf": round(medians["native"] / medians["hf"], 2),
            **(
                {"unpacked_over_hf": round(medians["native_unpacked"] / medians["hf"], 2)}
                if args.unpacked
                else {}
            ),
        }
        print(json.dumps({name: report[name]}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
