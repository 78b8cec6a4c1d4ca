"""A reward that keeps a core busy for a while a response (CPU_HEAVY_REWARD_S, default 0.2 s) before
checking the answer, as unit tests of generated code or a slow verifier would: the load for measuring
how scoring beside generation shares the CPUs with Ray workers (docs/benchmarks.md, "Ray workers'
niceness").

    --set reward.custom_function_path=bench/cpu_heavy_reward.py
"""

import os
import time

BUSY_S = float(os.environ.get("CPU_HEAVY_REWARD_S", "0.2"))


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    end = (
        time.process_time() + BUSY_S
    )  # CPU time, not wall time: the load is the same however it is scheduled
    while time.process_time() < end:
        pass
    return float(solution_str.strip().endswith(str(ground_truth)))
