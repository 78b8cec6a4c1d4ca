"""algorithm.rollout_correction: verl's truncated importance weights and rejection options, on
hand-computed values, and in a training step."""

import math

import pytest
import torch
from rl_run import config, read_metrics

from hybridflow.algorithms.rollout_correction import importance_weights, rejection_mask
from hybridflow.controller.trainer import RLTrainer
from hybridflow.errors import UserError


def test_token_k1_keeps_ratios_inside_the_bounds_and_ignores_padding():
    log_ratio = torch.tensor([[math.log(3.0), math.log(1.5), math.log(0.4), 5.0]])  # last is padding
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    keep, metrics = rejection_mask(log_ratio, mask, "token_k1", "0.5_2.0")
    assert keep.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert metrics["rollout_corr/rejected_fraction"] == pytest.approx(2 / 3)


def test_seq_mean_k3_against_its_hand_computed_value():
    # k3(r) = e^r - 1 - r: k3(0.1) = 0.0051709, k3(-0.1) = 0.0048374, mean 0.0050042
    log_ratio = torch.tensor([[0.1, -0.1, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rejected, _ = rejection_mask(log_ratio, mask, "seq_mean_k3", 0.005)
    assert rejected.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]  # the whole first sequence goes
    kept, metrics = rejection_mask(log_ratio, mask, "seq_mean_k3", 0.00501)
    assert kept.tolist() == mask.tolist() and metrics["rollout_corr/rejected_fraction"] == 0.0


def test_combined_options_must_all_pass_and_seq_max_skips_padding():
    log_ratio = torch.tensor([[0.0, 0.3, 9.0], [0.05, 0.0, 0.0]])  # 9.0 sits on padding
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # seq_max_k2 = max(r^2 / 2): 0.045 and 0.00125; seq_sum_k1 = -sum(r): -0.3 and -0.05
    keep, m = rejection_mask(log_ratio, mask, "seq_max_k2,seq_sum_k1", "0.05,0.8_1.2")
    # sequence 0 passes k2 (0.045 <= 0.05) but its ratio product e^0.3 = 1.35 is past 1.2
    assert keep.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert m["rollout_corr/seq_max_k2_rejected_fraction"] == 0.0
    assert m["rollout_corr/seq_sum_k1_rejected_fraction"] == pytest.approx(2 / 5)


def test_importance_weights_by_token_and_by_sequence():
    old, rollout = torch.tensor([[0.2, 0.3, 0.0]]), torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    token, m = importance_weights(old, rollout, mask, level="token", threshold=1.3)
    assert token[0].tolist() == pytest.approx([math.exp(0.2), 1.3, 0.0])
    assert m["rollout_corr/is_truncated_fraction"] == 0.5
    sequence, _ = importance_weights(old, rollout, mask, level="sequence", threshold=2.0)
    assert sequence[0].tolist() == pytest.approx([math.exp(0.5), math.exp(0.5), 0.0])  # e^(0.2+0.3) < 2
    normalized, _ = importance_weights(old, rollout, mask, level="token", threshold=10, batch_normalize=True)
    assert (normalized * mask).sum().item() == pytest.approx(2.0)  # mean 1 over the two tokens


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["algorithm.rollout_correction.rollout_rs=seq_k1"], "unknown option seq_k1"),
        (["algorithm.rollout_correction.rollout_rs=token_k2"], "needs rollout_rs_threshold"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ],
            "'lower_upper'",
        ),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k2,token_k3",
                "algorithm.rollout_correction.rollout_rs_threshold='1,2,3'",
            ],
            "3 entries for 2",
        ),
        (["algorithm.rollout_correction.rollout_is=geometric"], "rollout_is='geometric'"),
        (
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.rollout_is=token",
            ],
            "bypass_mode",
        ),
    ],
)
def test_bad_corrections_are_named(setup, tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        config(setup, tmp_path, *overrides)


def test_a_rejection_that_keeps_nothing_leaves_the_actor_no_tokens(setup, tmp_path):
    # fp32 on this CPU: trainer and rollout agree to ~1e-6, so every ratio is ~1, outside [1.5, 2]
    c = config(
        setup,
        tmp_path / "run",
        "trainer.total_training_steps=1",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold='1.5_2.0'",
    )
    RLTrainer(c).fit()
    (m,) = read_metrics(tmp_path / "run")
    assert m["rollout_corr/rejected_fraction"] == 1.0
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert m["actor/pg_loss"] == 0.0
