"""How a Ray worker fares beside busy reward workers (docs/benchmarks.md, "Ray workers' niceness"):
a CPU-bound call on a Ray actor, alone and while the run's RewardExecutor scores a batch with a
CPU-heavy reward (bench/cpu_heavy_reward.py): with Ray's default worker niceness (15); the same with
the scoring workers raised to it (what a run does beside a cluster it joins); and with the niceness of
a Ray instance a run starts itself (hybridflow.controller.ray_worker_group.WORKER_NICENESS). Each
setting in a fresh process (a Ray instance's niceness is fixed when it starts).

    OMP_NUM_THREADS=1 PYTHONPATH=. python bench/ray_niceness.py
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]


def busy_loop(n: int = 4_000_000) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i * i
    return time.perf_counter() - start


def measure(niceness: int | None, matched: bool) -> dict:
    import ray

    from hybridflow.controller.ray_worker_group import start_ray
    from hybridflow.rewards.executor import RewardExecutor
    from hybridflow.rewards.loading import load_custom_function

    if niceness is None:
        start_ray(num_cpus=2, log_to_driver=False)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 _system_config={"worker_niceness": niceness})  # fmt: skip
    worker = ray.remote(num_cpus=1)(Probe).remote()
    reward = str(ROOT / "bench" / "cpu_heavy_reward.py")
    executor = RewardExecutor(
        functools.partial(load_custom_function, reward, "compute_score"), num_workers=2, timeout_s=60
    )
    if matched:  # what a run does beside a cluster it joins: its scoring at the workers' niceness
        executor.run_at_niceness(ray.get(worker.niceness.remote()))
    executor.score([("x", "1", "1", {})] * 2)  # the workers started
    alone = ray.get(worker.loop.remote())
    items = [("x", "1", "1", {})] * 200  # 200 x 0.2 s of CPU: scoring outlasts the call below
    scoring = executor.submit(items)
    time.sleep(0.5)
    beside = ray.get(worker.loop.remote())
    scoring.result()
    executor.close()
    out = {"worker_niceness": ray.get(worker.niceness.remote()), "alone_s": round(alone, 3),
           "beside_scoring_s": round(beside, 3), "slowdown": round(beside / alone, 1)}  # fmt: skip
    ray.shutdown()
    return out


class Probe:
    def loop(self) -> float:
        return busy_loop()

    def niceness(self) -> int:
        return os.nice(0)


def main() -> None:
    if len(sys.argv) > 1:
        arg = sys.argv[1]
        print(json.dumps(measure(None if arg == "ours" else 15, matched=arg == "matched")))
        return
    names = {"15": "ray_default", "matched": "ray_default_scoring_matched", "ours": "hybridflow_local"}
    for setting, name in names.items():
        done = subprocess.run([sys.executable, __file__, setting], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
        line = [x for x in done.stdout.splitlines() if x.startswith("{")]
        print(json.dumps({name: json.loads(line[-1])}))


if __name__ == "__main__":
    main()
