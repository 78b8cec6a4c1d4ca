"""Scoring throughput: 10,000 GSM8K-style responses through the reward service.

python bench/reward_throughput.py [--n 10000] [--workers 0 2]
"""

from __future__ import annotations

import argparse
import random
import time

from hybridflow.rewards.executor import RewardExecutor
from hybridflow.rewards.loading import builtin_function


def responses(n: int, seed: int = 0, source: str = "gsm8k") -> list[tuple[str, str, str, dict]]:
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        if source == "math":  # math-verify does symbolic work: the expensive case
            p, q = rng.randint(1, 50), rng.randint(2, 50)
            shown = f"\\frac{{{p * 2}}}{{{q * 2}}}" if rng.random() < 0.6 else f"{p / q + 1:.3f}"
            items.append(
                (
                    "math",
                    f"Simplify the ratio. The answer is $\\boxed{{{shown}}}$.",
                    f"\\frac{{{p}}}{{{q}}}",
                    {},
                )
            )
            continue
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        answer = a + b if rng.random() < 0.6 else a + b + rng.randint(1, 9)
        steps = " ".join(
            f"Step {k}: we compute {rng.randint(1, 99)} apples and {rng.randint(1, 99)} pears."
            for k in range(8)
        )
        items.append(("openai/gsm8k", f"{steps}\nSo {a} + {b} = {answer}.\n#### {answer:,}", str(a + b), {}))
    return items


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--source", choices=["gsm8k", "math"], default="gsm8k")
    args = parser.parse_args()
    items = responses(args.n, source=args.source)
    for workers in args.workers:
        executor = RewardExecutor(builtin_function, num_workers=workers, timeout_s=10.0)
        executor.score(items[:100])  # warm the pool
        start = time.perf_counter()
        out = executor.score(items)
        seconds = time.perf_counter() - start
        executor.close()
        accuracy = sum(o.score for o in out) / len(out)
        print(
            f"{args.source} workers={workers}: {len(items)} responses in {seconds:.2f} s ({len(items) / seconds:,.0f}/s), mean score {accuracy:.3f}, errors {sum(o.error for o in out)}, timeouts {sum(o.timeout for o in out)}"
        )


if __name__ == "__main__":
    main()
