"""Held-out accuracy of a bench/real_gsm8k.py run validated on the whole test split, also on the first N
problems (the subset earlier runs were validated on), from the run's val_samples.jsonl
(trainer.log_val_generations): one line per validation.

    python bench/real_gsm8k_subset.py /tmp/res/dapo64_lr2e6_full --first 200
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import pandas as pd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the run's --out directory (holds test.parquet and the run dir)")
    ap.add_argument("--first", type=int, default=200)
    args = ap.parse_args()
    samples = next(args.out.glob("*/val_samples.jsonl"), None)
    if samples is None:
        raise SystemExit(f"{args.out}: no */val_samples.jsonl (run with trainer.log_val_generations=N)")
    test = pd.read_parquet(args.out / "test.parquet")
    subset = {str(p[-1]["content"]) for p in test["prompt"].head(args.first)}
    by_step: dict[int, list[tuple[str, float]]] = defaultdict(list)
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        by_step[row["step"]].append((row["prompt"], row["score"]))
    metrics = [json.loads(line) for line in next(args.out.glob("*/metrics.jsonl")).read_text().splitlines()]
    seconds, lenient, elapsed = {}, {}, 0.0
    for r in sorted(metrics, key=lambda r: r["step"]):
        elapsed += r.get("timing_s/step", 0.0)
        seconds[r["step"]] = elapsed
        lenient[r["step"]] = next(
            (v for k, v in r.items() if k.startswith("val-aux/") and "/lenient/" in k), None
        )
    for step, rows in sorted(by_step.items()):
        first = [score for prompt, score in rows if any(q in prompt for q in subset)]
        acc = sum(score for _, score in rows) / len(rows)
        err = math.sqrt(acc * (1 - acc) / len(rows))
        print(
            f"step {step:4d}  train_s {seconds.get(step, 0.0):7.1f}  strict {acc:.4f} +- {err:.4f} "
            f"(n={len(rows)})  lenient {lenient.get(step)}  first {len(first)}: {sum(first) / max(len(first), 1):.3f}"
        )


if __name__ == "__main__":
    main()
