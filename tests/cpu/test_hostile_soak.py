"""The soak of issue #26: two 200-step runs at once, on a machine kept busy by a third process,
with rewards that time out, raise, exit, segfault, print megabytes and return nonsense. Each run
finishes every step, counts what went wrong, and exits 0."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl_run import config

HOSTILE_REWARD = r"""
import ctypes, os, random, sys, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = random.randrange(40)  # not the response's: a policy that converges would escape them
    if kind == 0:
        time.sleep(3600)                   # past the deadline (the alarm ends it)
    if kind == 1:
        while True:                        # a busy loop the alarm ends too
            pass
    if kind == 2:
        raise ValueError("a buggy reward")
    if kind == 3:
        sys.exit(3)                        # an error for this response, not the run's end
    if kind == 4:
        os._exit(1)                        # the worker dies: replaced
    if kind == 5:
        ctypes.string_at(0)                # a segfault: replaced
    if kind == 6:
        print("x" * 5_000_000)             # megabytes on stdout
    if kind == 7:
        return float("nan")
    if kind == 8:
        return 1e39                        # finite in float64, inf in float32
    if kind == 9:
        return {"score": "high"}
    return solution_str.count("a") / max(len(solution_str), 1)
"""


@pytest.mark.trials
def test_two_hostile_200_step_runs_at_once_on_a_loaded_machine_finish(setup, tmp_path):
    (tmp_path / "hostile.py").write_text(HOSTILE_REWARD)
    runs = []
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # the machine is loaded
    try:
        for name in ("a", "b"):
            cfg = config(
                setup, tmp_path / name, f"reward.custom_function_path={tmp_path / 'hostile.py'}",
                "reward.num_workers=2", "reward.timeout_s=0.5", "reward.on_all_errors=warn",
                "trainer.total_training_steps=200", "data.prompts_per_step=4", "rollout.samples_per_prompt=2",
                "data.max_response_tokens=6", "trainer.log_samples_freq=50", "trainer.progress=false",
                "trainer.save_freq=50", "trainer.val_before_train=false",
            )  # fmt: skip
            from hybridflow.config import to_yaml

            (tmp_path / f"{name}.yaml").write_text(to_yaml(cfg))
            env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
            runs.append(subprocess.Popen(
                [sys.executable, "-m", "hybridflow.cli", "train", str(tmp_path / f"{name}.yaml")],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            ))  # fmt: skip
        deadline = time.monotonic() + 1500
        outputs = []
        for run in runs:
            out, _ = run.communicate(timeout=max(1, deadline - time.monotonic()))
            outputs.append(out)
            assert run.returncode == 0, out[-3000:]
    finally:
        busy.kill()
        for run in runs:
            run.kill()
    for name in ("a", "b"):
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, 201))
        errors, timeouts = sum(r["reward/errors"] for r in rows), sum(r["reward/timeouts"] for r in rows)
        # of 40 kinds, 5 are errors, 2 kill their worker (errors too), 2 time out, and 5 MB printed on a
        # loaded machine can pass the 0.5 s deadline: of 1,600 responses about 280 errors, 80-160 timeouts
        assert 150 < errors < 500 and 40 < timeouts < 300, (errors, timeouts)
        assert (tmp_path / name / "checkpoints" / "global_step_200").is_dir()
