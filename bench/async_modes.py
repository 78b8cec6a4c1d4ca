"""Synchronous vs one_step vs streaming training (issue #30): wall-clock, where each side waited, and
held-out accuracy, for the same recipe and seed. Each mode runs in its own `hybridflow train` process.

    python bench/async_modes.py                                  # the demo recipe on this CPU
    python bench/async_modes.py --recipe gsm8k_grpo --set model.path=/tmp/qwen   # a GPU run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="demo_arithmetic_grpo")
    ap.add_argument("--modes", default="off,one_step,streaming")
    ap.add_argument("--staleness", type=int, default=1, help="rollout.max_staleness for streaming")
    ap.add_argument("--out", type=Path, default=Path("/tmp/async_modes"))
    ap.add_argument("--set", action="append", default=[], help="more overrides, key=value")
    args = ap.parse_args()
    report = {}
    for mode in args.modes.split(","):
        run_dir = args.out / mode
        overrides = [
            f"trainer.async_mode={mode}",
            f"trainer.run_dir={run_dir}",
            "trainer.progress=false",
            *args.set,
        ]
        if mode == "streaming":
            overrides.append(f"rollout.max_staleness={args.staleness}")
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "hybridflow.cli", "train", args.recipe, "--overwrite", *overrides],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r["step"] > 0 and "timing_s/step" in r]
        val = {
            r["step"]: v for r in rows for k, v in r.items() if k.startswith("val-core/") and "/mean@" in k
        }

        def mean(key, steps=steps):
            return round(sum(r.get(key, 0.0) for r in steps) / len(steps), 3)

        report[mode] = {
            "wall_s": round(wall, 1),
            "steps_s": round(sum(r["timing_s/step"] for r in steps), 1),
            "step_s_mean": mean("timing_s/step"),
            "gen_wait_s_mean": mean("timing_s/gen"),  # the trainer waiting for its batch
            "update_actor_s_mean": mean("timing_s/update_actor"),
            "generation_idle_s_mean": mean("async/generation_idle_s"),
            "staleness_mean": mean("async/staleness_mean"),
            "score_mean_per_step": [round(r["critic/score/mean"], 3) for r in steps],
            "held_out": val,
        }
        print(json.dumps({mode: report[mode]}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
