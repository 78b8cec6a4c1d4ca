"""Every estimator against numbers worked out by hand, plus loop references and edge cases."""

import math
import random

import pytest
import torch
from torch.testing import assert_close

from hybridflow.algorithms.advantages import (
    gae,
    gpg,
    grpo,
    grpo_passk,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)
from hybridflow.algorithms.estimators import ESTIMATORS

T = torch.tensor


def ones(b, t=1):
    return torch.ones(b, t)


def test_grpo_hand():
    adv, ret = grpo(T([1.0, 0.0, 1.0, 0.5]), [0, 0, 1, 1], ones(4, 2))
    # group 0: mean .5, unbiased std .70711; group 1: mean .75, std .35355
    assert_close(adv[:, 0], T([0.70711, -0.70711, 0.70711, -0.70711]), atol=1e-5, rtol=0)
    assert torch.equal(adv, ret)
    dr, _ = grpo(T([1.0, 0.0, 1.0, 0.5]), [0, 0, 1, 1], ones(4), norm_by_std=False)
    assert_close(dr[:, 0], T([0.5, -0.5, 0.25, -0.25]))


def test_grpo_edge_cases():
    lone, _ = grpo(T([3.0]), ["only"], ones(1))  # group of one: mean 0, std 1
    assert_close(lone, T([[3.0 / (1 + 1e-6)]]))
    same, _ = grpo(T([0.7, 0.7, 0.7]), [1, 1, 1], ones(3))  # all equal: zero signal, no nan
    assert torch.equal(same, torch.zeros(3, 1))
    mask = T([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # an empty mask row
    adv, _ = grpo(T([1.0, 0.0]), [0, 0], mask)
    assert_close(adv, T([[0.70711, 0.70711, 0.0], [0.0, 0.0, 0.0]]), atol=1e-5, rtol=0)


def test_grpo_passk_hand():
    s = T([0.2, 0.9, 0.5])
    adv, _ = grpo_passk(s, ["a"] * 3, ones(3))
    assert_close(adv[:, 0], T([0.0, 0.4 / (0.351188 + 1e-6), 0.0]), atol=1e-5, rtol=0)
    raw, _ = grpo_passk(s, ["a"] * 3, ones(3), norm_by_std=False)
    assert_close(raw[:, 0], T([0.0, 0.4, 0.0]))
    ties, _ = grpo_passk(T([1.0, 1.0, 0.0, 2.0]), [0, 0, 0, 1], ones(4), norm_by_std=False)
    assert_close(ties[:, 0], T([0.0, 0.0, 0.0, 0.0]))  # tie: first best gets 1 - 1; lone group: 0


def test_rloo_hand():
    adv, _ = rloo(T([1.0, 0.0, 1.0, 0.5]), [0, 0, 0, 1], ones(4))
    # s_i minus the mean of the others: 1 - .5, 0 - 1, 1 - .5; group of one: 0
    assert_close(adv[:, 0], T([0.5, -1.0, 0.5, 0.0]))


def test_opo_hand():
    mask = T([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])  # lengths 2 and 4
    adv, _ = opo(T([1.0, 0.0]), [0, 0], mask)
    # baseline (2*1 + 4*0) / 6 = 1/3
    assert_close(adv, T([[2 / 3, 2 / 3, 0, 0], [-1 / 3, -1 / 3, -1 / 3, -1 / 3]]))


def test_gpg_hand():
    adv, _ = gpg(T([1.0, 0.0, 1.0, 1.0]), [0, 0, 1, 1], ones(4))
    # alpha = 4 / 3 nonzero scores
    assert_close(adv[:, 0], T([2 / 3, -2 / 3, 0.0, 0.0]))


def test_reinforce_plus_plus_hand():
    rewards, mask = T([[0.0, 1.0], [0.0, 0.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    adv, ret = reinforce_plus_plus(rewards, mask)
    assert_close(ret, T([[1.0, 1.0], [0.0, 0.0]]))
    # masked values 1, 1, 0: mean 2/3, unbiased var 1/3
    assert_close(adv, T([[0.57735, 0.57735], [-1.15470, 0.0]]), atol=1e-5, rtol=0)
    _, discounted = reinforce_plus_plus(rewards, mask, gamma=0.5)
    assert_close(discounted[0], T([0.5, 1.0]))


def test_reinforce_plus_plus_baseline_hand():
    adv, _ = reinforce_plus_plus_baseline(T([1.0, 0.0, 1.0, 1.0]), [0, 0, 1, 1], ones(4))
    # group-centred [.5, -.5, 0, 0], whitened: unbiased var 1/6
    assert_close(adv[:, 0], T([1.22474, -1.22474, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_remax_hand():
    adv, ret = remax(T([[0.0, 0.0, 1.0]]), T([0.25]), ones(1, 3))
    assert_close(ret, T([[1.0, 1.0, 1.0]]))
    assert_close(adv, T([[0.75, 0.75, 0.75]]))


def test_gae_hand():
    rewards, values, mask = T([[0.0, 1.0]]), T([[0.5, 0.2]]), ones(1, 2)
    adv, ret = gae(rewards, values, mask)
    # A1 = 1 - .2 = .8; A0 = (0 + .2 - .5) + .8 = .5; returns = A + V = [1, 1]; whiten [.5, .8]
    assert_close(ret, T([[1.0, 1.0]]))
    assert_close(adv, T([[-0.70711, 0.70711]]), atol=1e-5, rtol=0)
    _, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # A1 = .8; A0 = (0 + .9*.2 - .5) + .9*.8*.8 = .256
    assert_close(ret, T([[0.256 + 0.5, 0.8 + 0.2]]))


def test_gae_skips_positions_outside_the_mask():
    # an unmasked middle position must not cut the return: same as the two-token case above
    rewards, values, mask = T([[0.0, 9.0, 1.0]]), T([[0.5, 7.0, 0.2]]), T([[1.0, 0.0, 1.0]])
    _, ret = gae(rewards, values, mask)
    assert_close(ret, T([[1.0, 0.0, 1.0]]))


def _loop_group_reference(scores, groups, fn):
    out = []
    for i, g in enumerate(groups):
        members = [scores[j] for j, h in enumerate(groups) if h == g]
        others = [scores[j] for j, h in enumerate(groups) if h == g and j != i]
        out.append(fn(scores[i], members, others))
    return T(out)


def _std(xs):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_group_code_matches_plain_loops(seed):
    rng = random.Random(seed)
    groups = [rng.choice("abcdefg") for _ in range(40)]
    scores = [float(rng.choice([0, 0.5, 1, rng.random()])) for _ in groups]
    s, m = T(scores), ones(len(scores))

    def grpo_ref(x, members, others):
        if len(members) == 1:
            return x / (1 + 1e-6)
        return (x - sum(members) / len(members)) / (_std(members) + 1e-6)

    def rloo_ref(x, members, others):
        return x - sum(others) / len(others) if others else 0.0

    def gpg_ref(x, members, others):
        alpha = len(scores) / max(1, sum(1 for v in scores if v != 0))
        return alpha * (x - (sum(members) / len(members) if len(members) > 1 else 0.0))

    assert_close(
        grpo(s, groups, m)[0][:, 0], _loop_group_reference(scores, groups, grpo_ref), atol=1e-4, rtol=1e-5
    )
    assert_close(
        rloo(s, groups, m)[0][:, 0], _loop_group_reference(scores, groups, rloo_ref), atol=1e-5, rtol=1e-5
    )
    assert_close(
        gpg(s, groups, m)[0][:, 0], _loop_group_reference(scores, groups, gpg_ref), atol=1e-5, rtol=1e-5
    )

    passk, _ = grpo_passk(s, groups, m, norm_by_std=False)
    expected = []
    for i, g in enumerate(groups):
        idx = [j for j, h in enumerate(groups) if h == g]
        best = max(idx, key=lambda j: (scores[j], -j))
        rest = sorted((scores[j] for j in idx if j != best), reverse=True)
        expected.append(scores[best] - rest[0] if i == best and rest else 0.0)
    assert_close(passk[:, 0], T(expected))


def test_group_ids_may_be_tensors_or_hashables():
    s, m = T([1.0, 0.0, 2.0, 2.0]), ones(4)
    assert torch.equal(
        grpo(s, torch.tensor([5, 5, 9, 9]), m)[0], grpo(s, [("p", 1), ("p", 1), "q", "q"], m)[0]
    )


def test_registry_names_are_verls_and_each_says_what_it_needs():
    assert set(ESTIMATORS) == {
        "gae", "grpo", "grpo_passk", "rloo", "opo", "gpg",
        "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
    }  # fmt: skip
    assert {n for n, e in ESTIMATORS.items() if e.needs_critic} == {"gae"}
    assert {n for n, e in ESTIMATORS.items() if e.needs_greedy_baseline} == {"remax"}


def test_bf16_scores_and_single_token_masks_stay_finite():
    s = T([1.0, 0.0, 1.0]).bfloat16()
    mask = T([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    for fn in (grpo, rloo, opo, gpg, reinforce_plus_plus_baseline):
        adv, _ = fn(s, [0, 0, 0], mask)
        assert torch.isfinite(adv).all()
        assert (adv[mask == 0] == 0).all()
