"""Runs that repeat: the same config and seed, in two processes started separately, give bit-identical
weights and metrics after three steps, synchronous (async_mode=off) and streaming (the engine pausing
for training, one update of staleness), with or without trainer.deterministic (torch's deterministic
algorithms: GPUs need them, CPU kernels are so already); another seed gives another run. On CPU this holds at one torch
thread count: a matmul's summation order depends on it (rows of a K=1536 product differ between one
and two threads here), so two runs compared must use the same OMP_NUM_THREADS."""

import os
import subprocess
import sys

import pytest
from rl_run import arguments, measured, read_metrics


def _run(setup, run_dir, *extra):
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = [sys.executable, "-m", "hybridflow.cli", "train",
               *arguments(setup, run_dir, "trainer.total_training_steps=3", "trainer.save_freq=3", *extra),
               "--quiet"]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process):
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err[-3000:]


def _measured(run_dir):
    return measured(read_metrics(run_dir))


def _weights(run_dir):
    return (run_dir / "checkpoints" / "global_step_3" / "policy" / "model.safetensors").read_bytes()


@pytest.mark.parametrize(
    "mode",
    [["trainer.async_mode=off"], ["trainer.async_mode=streaming", "rollout.max_staleness=1"]],
    ids=["synchronous", "streaming"],
)
def test_two_processes_with_one_seed_give_the_same_run_to_the_bit(setup, tmp_path, mode):
    # b asks for torch's deterministic algorithms (trainer.deterministic, for GPUs): on CPU the same run
    runs = {name: _run(setup, tmp_path / name, *mode, *extra) for name, extra in
            (("a", []), ("b", ["trainer.deterministic=true"]), ("other_seed", ["trainer.seed=1"]))}  # fmt: skip
    for process in runs.values():
        _finish(process)
    a, b = _measured(tmp_path / "a"), _measured(tmp_path / "b")
    assert [row["step"] for row in a] == [1, 2, 3]
    assert a == b  # every loss, reward, length, gradient norm and log-prob gap, exactly
    assert _weights(tmp_path / "a") == _weights(tmp_path / "b")
    assert _measured(tmp_path / "other_seed") != a  # (the comparison can fail)
    assert _weights(tmp_path / "other_seed") != _weights(tmp_path / "a")
    if "trainer.async_mode=streaming" in mode:
        assert max(row["async/staleness_max"] for row in a) == 1.0  # it streamed, one update stale
