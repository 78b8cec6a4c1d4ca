"""Losses against hand-computed numbers; split-invariance of every aggregation; numerics."""

import math

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algorithms.losses import (
    AGG_MODES,
    AdaptiveKLController,
    FixedKLController,
    aggregate,
    count_sequences,
    count_tokens,
    entropy_from_logits,
    entropy_from_logits_chunked,
    filter_zero_variance_groups,
    kl_penalty,
    overlong_penalty,
    policy_loss,
    truncated_importance_weights,
    value_loss,
)

T = torch.tensor
LN = math.log


def test_aggregate_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row empty: never counted
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(10 / 2)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", scale=10).item() == pytest.approx((0.6 + 0.4) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        aggregate(loss, mask, "mean")


def test_kl_estimators_hand():
    logp, ref = T([LN(0.5)]), T([LN(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN(2))
    assert kl_penalty(logp, ref, "kl").item() == pytest.approx(LN(2))
    assert kl_penalty(ref, logp, "abs").item() == pytest.approx(LN(2))
    assert kl_penalty(logp, ref, "mse").item() == pytest.approx(0.5 * LN(2) ** 2)
    # k3: r = p_ref / p = .5; r - log r - 1 = .5 + ln 2 - 1
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 + LN(2) - 1)
    assert kl_penalty(T([0.0]), T([-100.0]), "k3").item() == pytest.approx(10.0)  # clamped
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(logp, ref, "k7")


@pytest.mark.parametrize("kind", ["k1+", "k2+", "k3+"])
def test_straight_through_kl_has_estimator_value_and_k2_gradient(kind):
    logp = T([LN(0.5)], requires_grad=True)
    value = kl_penalty(logp, T([LN(0.25)]), kind)
    assert value.item() == pytest.approx(kl_penalty(logp, T([LN(0.25)]), kind[:-1]).item())
    value.sum().backward()
    assert logp.grad.item() == pytest.approx(LN(2))  # d/dlogp of (logp - ref)^2 / 2


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(10.0, 100)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(0.1, target_kl=0.1, horizon=100)
    ctl.update(0.2, n_steps=10)  # error clipped to +0.2: x (1 + .2 * 10 / 100)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(0.05, n_steps=10)  # error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(0.102 * 0.98)
    restored = AdaptiveKLController(1.0, 0.1, 100)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def _one_token_each(ratios, advantages):
    logp = T([[LN(r)] for r in ratios], requires_grad=True)
    return logp, torch.zeros(len(ratios), 1), T([[a] for a in advantages]), torch.ones(len(ratios), 1)


def test_vanilla_ppo_hand():
    logp, old, adv, mask = _one_token_each([1.5, 0.9, 0.5, 5.0], [1, 1, -1, -1])
    loss, m = policy_loss("vanilla", logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    # per token: max(-1.5, -1.2) = -1.2; -0.9; max(.5, .8) = .8; dual clip min(3, max(5, 1.2)) = 3
    assert loss.item() == pytest.approx((-1.2 - 0.9 + 0.8 + 3.0) / 4)
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.25)
    assert m["ppo_kl"].item() == pytest.approx(-(LN(1.5) + LN(0.9) + LN(0.5) + LN(5.0)) / 4)
    loss.backward()
    # only the unclipped token (ratio .9, A=1) carries gradient: d(-A r)/dlogp = -r, / 4 tokens
    assert_close(logp.grad[:, 0], T([0.0, -0.9 / 4, 0.0, 0.0]))
    higher, _ = policy_loss("vanilla", *_one_token_each([1.5], [1]), clip_high=0.28)
    assert higher.item() == pytest.approx(-1.28)


def test_gspo_hand():
    logp = T([[LN(1.1), LN(1.3)]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    loss, _ = policy_loss("gspo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    s = math.sqrt(1.1 * 1.3)  # geometric mean of the token ratios
    assert loss.item() == pytest.approx(-s, rel=1e-6)
    loss.backward()
    assert_close(logp.grad, T([[-s / 2, -s / 2]]))
    clipped, _ = policy_loss("gspo", logp, old, adv, mask, clip_low=0.1, clip_high=0.1)
    assert clipped.item() == pytest.approx(-1.1)


def test_cispo_gpg_sapo_hand():
    logp, old, adv, mask = _one_token_each([2.0], [1])
    loss, m = policy_loss("cispo", logp, old, adv, mask)
    # ratio 2 clipped to 1.2 but kept as a constant weight: -1.2 * 1 * log p
    assert loss.item() == pytest.approx(-1.2 * LN(2.0))
    loss.backward()
    assert logp.grad.item() == pytest.approx(-1.2)
    assert m["pg_clipfrac"].item() == 1.0

    logp = T([[LN(0.5)]], requires_grad=True)
    loss, _ = policy_loss("gpg", logp, logp.detach(), T([[2.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-2 * LN(0.5))

    logp = T([[0.0], [0.0]], requires_grad=True)
    loss, _ = policy_loss("sapo", logp, torch.zeros(2, 1), T([[1.0], [-1.0]]), torch.ones(2, 1))
    # gate(r=1) = sigmoid(0) * 4 / tau: 2 for tau_pos = 1, 1.904762 for tau_neg = 1.05
    assert loss.item() == pytest.approx((-2.0 + 4 * 0.5 / 1.05) / 2, rel=1e-5)
    loss.backward()
    assert_close(logp.grad[:, 0], T([-0.5, 0.5]))  # on-policy gradient equals vanilla's


def test_geo_mean_hand():
    logp = T([[0.1, -0.5], [0.1, -0.5]])
    adv = T([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = policy_loss(
        "geo_mean", logp, torch.zeros(2, 2), adv, torch.ones(2, 2), clip_low=0.4, clip_high=0.4
    )
    # A > 0: pessimistic log-ratios [.1, -.5] -> exp(-.2); A < 0: [.1, -.4] -> exp(-.15)
    assert loss.item() == pytest.approx((-math.exp(-0.2) + math.exp(-0.15)) / 2)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(0.25)


def test_clip_cov_and_kl_cov_hand():
    logp = T([[-1.0, -3.0, -2.0, -2.0]])  # centred [1, -1, 0, 0]
    adv = T([[2.0, -2.0, 0.0, 0.0]])  # centred itself; covariance [2, 2, 0, 0], inside (1, 5)
    mask = torch.ones(1, 4)
    loss, m = policy_loss("clip_cov", logp, logp, adv, mask, clip_cov_ratio=0.5)
    assert loss.item() == 0.0 and m["pg_clipfrac"].item() == 0.5  # both candidates cut
    gen = torch.Generator().manual_seed(0)
    loss, m = policy_loss("clip_cov", logp, logp, adv, mask, clip_cov_ratio=1e-4, generator=gen)
    assert abs(loss.item()) == pytest.approx(0.5) and m["pg_clipfrac"].item() == 0.25  # one of the two cut

    logp = T([[-1.0, -2.0, -2.0, -2.0]])
    adv = T([[3.0, -1.0, -1.0, -1.0]])  # covariance [2.25, .25, .25, .25]: token 0 is the top one
    old = logp - T([[0.1, 0.0, 0.0, 0.0]])
    loss, _ = policy_loss("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.25)
    assert loss.item() == pytest.approx((-3 * math.exp(0.1) + 0.1 + 3.0) / 4)


def test_unknown_policy_loss():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'"):
        policy_loss("ppo2", *_one_token_each([1.0], [1.0]))


def test_value_loss_hand():
    values, old, ret = T([[1.0, 2.0, 0.0]]), T([[0.5, 0.5, 1.0]]), T([[2.0, 0.0, 0.0]])
    loss, m = value_loss(values, old, ret, torch.ones(1, 3), clip=0.5)
    # token 0: clip(1) = 1 -> 1; token 1: max(4, (1 - 0)^2) = 4; token 2: max(0, (.5)^2) = .25
    assert loss.item() == pytest.approx(0.5 * (1 + 4 + 0.25) / 3)
    assert m["vf_clipfrac"].item() == pytest.approx(1 / 3)


def test_entropy_hand_and_chunked_equals_naive():
    assert entropy_from_logits(torch.zeros(4)).item() == pytest.approx(LN(4))
    p = T([0.25, 0.75])
    assert entropy_from_logits(p.log()).item() == pytest.approx(-(0.25 * LN(0.25) + 0.75 * LN(0.75)))
    logits = torch.randn(37, 50, dtype=torch.float64).float().requires_grad_()
    naive = entropy_from_logits(logits)
    weights = torch.randn(37)
    (naive * weights).sum().backward()
    grad_naive = logits.grad.clone()
    logits.grad = None
    chunked = entropy_from_logits_chunked(logits, chunk_rows=8)
    (chunked * weights).sum().backward()
    assert_close(chunked, naive, atol=1e-6, rtol=0)
    assert_close(logits.grad, grad_naive, atol=1e-6, rtol=0)


def test_truncated_importance_weights_hand():
    old, rollout, mask = T([[0.1, -0.2, 5.0]]), torch.zeros(1, 3), T([[1.0, 1.0, 0.0]])
    token = truncated_importance_weights(old, rollout, mask, cap=2.0)
    assert_close(token, T([[math.exp(0.1), math.exp(-0.2), 0.0]]))
    seq = truncated_importance_weights(old, rollout, mask, level="sequence")
    assert_close(seq, T([[math.exp(-0.1), math.exp(-0.1), 0.0]]))
    capped = truncated_importance_weights(T([[LN(0.5)]]), T([[LN(0.25)]]), torch.ones(1, 1), cap=1.5)
    assert capped.item() == pytest.approx(1.5)


def test_dapo_helpers_hand():
    assert_close(overlong_penalty(T([70, 80, 90, 100]), 100, 20, 1.0), T([0.0, 0.0, -0.5, -1.0]))
    keep = filter_zero_variance_groups(T([1.0, 1.0, 0.0, 1.0, 5.0]), [0, 0, 1, 1, 2])
    assert keep.tolist() == [False, False, True, True, True]


VARIANTS = ["vanilla", "gspo", "cispo", "gpg", "sapo", "geo_mean"]  # clip_cov/kl_cov use batch statistics


def _random_batch(seed, B=8, L=6):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, L, generator=g) < 0.8).float()
    mask[0] = 0  # an empty row
    mask[1, 1:] = 0  # a single-token row
    logp = -torch.rand(B, L, generator=g) * 3
    old = logp + torch.randn(B, L, generator=g) * 0.3
    adv = torch.randn(B, L, generator=g)
    return logp, old, adv, mask


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_splits_sum_to_the_full_batch(kind, agg):
    logp, old, adv, mask = _random_batch(1)
    tokens, seqs = count_tokens(mask), count_sequences(mask)
    results = []
    for pieces in (1, 2, 4):
        param = logp.clone().requires_grad_()
        total = sum(
            policy_loss(kind, p, o, a, m, agg=agg, global_tokens=tokens, global_seqs=seqs, scale=6)[0]
            for p, o, a, m in zip(
                param.chunk(pieces), old.chunk(pieces), adv.chunk(pieces), mask.chunk(pieces)
            )
        )
        total.backward()
        results.append((total.detach(), param.grad))
    for loss, grad in results[1:]:
        assert_close(loss, results[0][0], atol=1e-6, rtol=1e-6)
        assert_close(grad, results[0][1], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_value_loss_split_invariance(agg):
    logp, old, ret, mask = _random_batch(2)
    full, _ = value_loss(
        logp, old, ret, mask, agg=agg, global_tokens=count_tokens(mask), global_seqs=count_sequences(mask)
    )
    parts = sum(
        value_loss(v, o, r, m, agg=agg, global_tokens=count_tokens(mask), global_seqs=count_sequences(mask))[
            0
        ]
        for v, o, r, m in zip(logp.chunk(4), old.chunk(4), ret.chunk(4), mask.chunk(4))
    )
    assert_close(parts, full)


@pytest.mark.parametrize("kind", [*VARIANTS, "clip_cov", "kl_cov"])
def test_extreme_log_prob_gaps_and_bf16_stay_finite(kind):
    logp, old, adv, mask = _random_batch(3)
    old = logp + T([100.0, -100.0]).repeat(24)[:48].reshape(8, 6)  # ratios of e^-100 and e^100
    for dtype in (torch.float32, torch.bfloat16):
        param = logp.detach().to(dtype).requires_grad_()
        loss, metrics = policy_loss(kind, param, old.to(dtype), adv.to(dtype), mask.to(dtype))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(param.grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())


def test_importance_weights_multiply_the_loss():
    logp, old, adv, mask = _random_batch(4)
    w = torch.full_like(logp, 0.5)
    plain, _ = policy_loss("vanilla", logp, old, adv, mask)
    weighted, _ = policy_loss("vanilla", logp, old, adv, mask, importance_weights=w)
    assert_close(weighted, plain * 0.5)
