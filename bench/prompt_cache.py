"""Loading 100k chat prompts: tokenizing the jsonl every run vs the tokenized cache (PackedDataset).

    PYTHONPATH=. python bench/prompt_cache.py OUT [--rows 100000]

Rows in verl's schema (a user message of 40-120 words, a ground truth), rendered with the embedded
default model's (SmolLM2-135M-Instruct) chat template and tokenizer. Times: `load_prompts` without the
cache, with an empty cache (tokenize + write), and with the cache filled (read only).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from hybridflow.config.schema import DataConfig
from hybridflow.data import load_prompts
from hybridflow.models import load_tokenizer

WORDS = [
    "the",
    "a",
    "number",
    "of",
    "apples",
    "each",
    "box",
    "holds",
    "more",
    "than",
    "twice",
    "as",
    "many",
    "left",
    "after",
    "she",
    "buys",
    "sells",
    "gives",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rows", type=int, default=100_000)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    data = args.out / "prompts.jsonl"
    with data.open("w") as f:
        for i in range(args.rows):
            question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + f" {i}?"
            row = {"prompt": [{"role": "user", "content": question}], "data_source": "gsm8k",
                   "reward_model": {"ground_truth": str(i)}, "extra_info": {"index": i}}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    tokenizer = load_tokenizer("default")
    config = DataConfig(max_prompt_tokens=1024)
    cache = args.out / "cache"
    times = {}
    for name, root in (("tokenize", None), ("cache_build", cache), ("cache_hit", cache)):
        start = time.perf_counter()
        prompts = load_prompts([str(data)], tokenizer, config, cache_root=root)
        times[name] = time.perf_counter() - start
    tokens = sum(len(p.token_ids) for p in prompts)
    print(json.dumps({"rows": args.rows, "prompt_tokens": tokens, "seconds": times,
                      "speedup_hit_vs_tokenize": times["tokenize"] / times["cache_hit"]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
