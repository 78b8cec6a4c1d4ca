"""What the default-on guards cost and what they saw, from runs' metrics.jsonl: per step the
weight-sync check's time against the step's, and the probability gap and first-mini-batch ppo_kl
that the other guards bound.

    python bench/guards_overhead.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summary(run_dir: Path) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) > 1]  # step 1 compiles and captures
    check = [r["timing_s/weight_check"] * 1000 for r in rows if "timing_s/weight_check" in r]
    step = [r["timing_s/step"] for r in rows]
    share = [c / 1000 / s * 100 for c, s in zip(check, step)]
    gap = [r["training/rollout_probs_diff_mean"] for r in rows if "training/rollout_probs_diff_mean" in r]
    kl = [abs(r["training/first_minibatch_ppo_kl"]) for r in rows if "training/first_minibatch_ppo_kl" in r]
    out = (
        f"{run_dir}: {len(rows)} steps; weight check median {statistics.median(check):.2f} ms of a "
        f"{statistics.median(step):.3f} s step ({max(share):.3f}% at most)"
    )
    if gap:
        out += f"; probability gap mean {min(gap):.2g}-{max(gap):.2g}"
    if kl:
        out += f"; |first mini-batch ppo_kl| <= {max(kl):.2g}"
    return out


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(summary(Path(arg)))
