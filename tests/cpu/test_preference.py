"""Preference and SFT losses against hand-computed numbers, and split invariance."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algorithms.preference import dpo_loss, kto_loss, orpo_loss, sft_loss, simpo_loss

T = torch.tensor


def _neg_logsigmoid(x):
    return math.log1p(math.exp(-x))


@pytest.mark.parametrize(
    "kind, smoothing, expected",
    [
        ("sigmoid", 0.0, _neg_logsigmoid(0.1)),
        ("sigmoid", 0.1, 0.9 * _neg_logsigmoid(0.1) + 0.1 * _neg_logsigmoid(-0.1)),
        ("robust", 0.1, (0.9 * _neg_logsigmoid(0.1) - 0.1 * _neg_logsigmoid(-0.1)) / 0.8),
        ("hinge", 0.0, 0.9),
        ("ipo", 0.0, (1 - 1 / (2 * 0.1)) ** 2),
    ],
)
def test_dpo_variants_hand(kind, smoothing, expected):
    # h = (pi_c - pi_r) - (ref_c - ref_r) = (-1 + 2) - 0 = 1, beta = .1
    loss, m = dpo_loss(
        T([-1.0]), T([-2.0]), T([-1.5]), T([-1.5]), beta=0.1, label_smoothing=smoothing, kind=kind
    )
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx(0.05)
    assert m["rewards/rejected"].item() == pytest.approx(-0.05)
    assert m["rewards/accuracies"].item() == 1.0
    assert m["rewards/margins"].item() == pytest.approx(0.1)


def test_kto_hand():
    loss, m = kto_loss(T([-1.0, -3.0]), T([-2.0, -2.0]), T([True, False]), 0.5, beta=1.0)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # desirable: 1 - s(1 - .5); undesirable: 1 - s(.5 - (-1))
    assert loss.item() == pytest.approx(((1 - sig(0.5)) + (1 - sig(1.5))) / 2, rel=1e-6)
    assert m["rewards/chosen"].item() == pytest.approx(1.0) and m["rewards/rejected"].item() == pytest.approx(
        -1.0
    )
    weighted, _ = kto_loss(
        T([-1.0, -3.0]), T([-2.0, -2.0]), T([True, False]), 0.5, beta=1.0, undesirable_weight=2.0
    )
    assert weighted.item() == pytest.approx(((1 - sig(0.5)) + 2 * (1 - sig(1.5))) / 2, rel=1e-6)
    negative_kl, _ = kto_loss(T([-1.0]), T([-2.0]), T([True]), -3.0, beta=1.0)  # KL estimate clamped at 0
    assert negative_kl.item() == pytest.approx(1 - sig(1.0), rel=1e-6)


def test_simpo_and_orpo_hand():
    loss, _ = simpo_loss(T([-0.5]), T([-1.0]), beta=2.0, gamma=1.0)
    assert loss.item() == pytest.approx(math.log(2))  # beta (c - r) - gamma = 0
    loss, m = orpo_loss(T([math.log(0.5)]), T([math.log(0.25)]), T([1.0]), beta=0.1)
    # odds(.5) = 1, odds(.25) = 1/3: log odds ratio ln 3; log s(ln 3) = ln .75
    assert loss.item() == pytest.approx(1.0 - 0.1 * math.log(0.75), rel=1e-6)
    assert m["log_odds_chosen"].item() == pytest.approx(math.log(3), rel=1e-6)


def test_sft_loss_hand():
    logp, mask = T([[-1.0, -2.0], [-3.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    assert sft_loss(logp, mask).item() == pytest.approx(2.0)
    assert sft_loss(logp[:1], mask[:1], global_tokens=3).item() + sft_loss(
        logp[1:], mask[1:], global_tokens=3
    ).item() == pytest.approx(2.0)


def test_dpo_and_kto_split_invariance():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (-torch.rand(8, generator=g) * 5 for _ in range(4))
    for kind in ("sigmoid", "ipo", "hinge", "robust"):
        full, _ = dpo_loss(pc, pr, rc, rr, kind=kind, label_smoothing=0.1 if kind == "robust" else 0.0)
        parts = sum(
            dpo_loss(a, b, c, d, kind=kind, label_smoothing=0.1 if kind == "robust" else 0.0, global_seqs=8)[
                0
            ]
            for a, b, c, d in zip(pc.chunk(4), pr.chunk(4), rc.chunk(4), rr.chunk(4))
        )
        assert_close(parts, full)
    desirable = torch.arange(8) % 3 == 0
    full, _ = kto_loss(pc, rc, desirable, 0.2)
    parts = sum(
        kto_loss(a, b, d, 0.2, global_seqs=8)[0]
        for a, b, d in zip(pc.chunk(2), rc.chunk(2), desirable.chunk(2))
    )
    assert_close(parts, full)


def test_extreme_preference_inputs_stay_finite():
    big = T([-1000.0, 0.0])
    for loss, _ in (
        dpo_loss(big, -big, big, big),
        simpo_loss(big, -big),
        orpo_loss(T([-1e-9, -50.0]), T([-50.0, -1e-9]), T([0.0, 0.0])),
    ):
        assert torch.isfinite(loss)
