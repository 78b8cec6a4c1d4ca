"""Offload in one worker: FSDP2 over a one-rank group keeps the actor's and reference's parameters
(and the actor's gradients and Adam state) in CPU memory; actor.offload_optimizer parks Adam's state
there between updates. On a CPU the memory does not move, but the code path is the GPU's: the same
step, the same weights as the plain run, and checkpoints that move between the two."""

import pytest
from rl_run import config, read_metrics
from test_distributed_trainer import ROLES, _assert_same_step, _assert_same_weights, _policy

from hybridflow.controller.trainer import RLTrainer

OFFLOAD = ["actor.offload_params=true", "ref.offload_params=true"]


def _train(setup, run_dir, steps, *extra):
    RLTrainer(config(setup, run_dir, *ROLES, f"trainer.total_training_steps={steps}", *extra)).fit()
    return {m["step"]: m for m in read_metrics(run_dir)}


@pytest.mark.slow
def test_offloaded_actor_and_reference_train_as_the_plain_run(setup, tmp_path):
    plain = _train(setup, tmp_path / "plain", 2)
    # offloaded from the start: the same two steps
    offloaded = _train(setup, tmp_path / "off", 2, *OFFLOAD)
    for step in (1, 2):
        _assert_same_step(plain[step], offloaded[step])
    _assert_same_weights(_policy(tmp_path / "plain", 2), _policy(tmp_path / "off", 2))
    # a plain checkpoint resumes with the optimizer state parked in CPU memory between updates
    _train(setup, tmp_path / "mixed", 1)
    mixed = _train(setup, tmp_path / "mixed", 2, "actor.offload_optimizer=true")
    _assert_same_step(plain[2], mixed[2])
    _assert_same_weights(_policy(tmp_path / "plain", 2), _policy(tmp_path / "mixed", 2))
