"""Loss masks end to end (issue #29, part 1): a response may interleave tokens the policy sampled (mask
1, trained) with tokens it did not (a tool's output, an environment's answer: mask 0). Every estimator,
loss and metric honours the mask; the single-turn path is the mask-of-ones case with identical numbers."""

import copy

import torch
from torch.testing import assert_close

from hybridflow.algorithms.advantages import gae, reinforce_plus_plus, remax
from hybridflow.batch import Prompt, Rollouts, TrainingBatch, pad_ragged
from hybridflow.config.schema import ActorConfig
from hybridflow.controller.advantage import token_level_rewards
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.roles.actor import Actor

T = torch.tensor


def test_reinforce_plus_plus_carries_returns_across_observation_spans_by_hand():
    # policy tokens 0, 1 and 4; a tool's output at 2-3; padding at 5; the outcome reward at 4
    rewards = T([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # G_4 = 1; G_1 = 0 + 0.5 G_4 (the observation span is skipped, not discounted); G_0 = 0.5 G_1
    assert_close(ret, T([[0.25, 0.5, 0.0, 0.0, 1.0, 0.0]]))
    # whitened over [0.25, 0.5, 1]: mean 7/12, unbiased variance 7/48
    assert_close(adv, T([[-0.87287, -0.21822, 0.0, 0.0, 1.09109, 0.0]]), atol=1e-5, rtol=0)
    # verl#7278's check: removing the observation tokens changes no policy token's return
    compact, _ = reinforce_plus_plus(T([[0.0, 0.0, 1.0]]), torch.ones(1, 3), gamma=0.9)
    expanded, _ = reinforce_plus_plus(
        T([[0.0, 0.0, 0.0, 0.0, 1.0]]), T([[1.0, 1.0, 0.0, 0.0, 1.0]]), gamma=0.9
    )
    _, compact_ret = reinforce_plus_plus(T([[0.0, 0.0, 1.0]]), torch.ones(1, 3), gamma=0.9)
    _, expanded_ret = reinforce_plus_plus(
        T([[0.0, 0.0, 0.0, 0.0, 1.0]]), T([[1.0, 1.0, 0.0, 0.0, 1.0]]), gamma=0.9
    )
    assert_close(expanded_ret[:, [0, 1, 4]], compact_ret)
    assert_close(expanded[:, [0, 1, 4]], compact)


def test_gae_and_remax_over_an_observation_span_equal_the_compact_episode():
    rewards, values = T([[0.0, 0.0, 0.0, 1.0]]), T([[0.2, 0.4, 9.0, 0.7]])  # 9.0: a masked position's value
    mask = T([[1.0, 1.0, 0.0, 1.0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    c_adv, c_ret = gae(T([[0.0, 0.0, 1.0]]), T([[0.2, 0.4, 0.7]]), torch.ones(1, 3), gamma=0.9, lam=0.8)
    assert_close(adv[:, [0, 1, 3]], c_adv)
    assert_close(ret[:, [0, 1, 3]], c_ret)
    assert adv[0, 2] == 0 and ret[0, 2] == 0
    adv, ret = remax(rewards, T([0.25]), mask)
    assert_close(adv, T([[0.75, 0.75, 0.0, 0.75]]))


def test_outcome_reward_lands_on_the_last_token_the_policy_sampled():
    mask = T([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    rewards = token_level_rewards(T([1.0, 2.0, 3.0, 4.0]), mask)
    expected = torch.zeros(4, 4)
    expected[0, 1], expected[1, 2], expected[2, 3] = 1.0, 2.0, 3.0  # none for a row with no policy token
    assert torch.equal(rewards, expected)


def test_rollouts_keep_their_masks_through_select_and_concat():
    prompt = Prompt(0, [1, 2], "s")
    single = Rollouts([[1, 2]], [[3, 4, 5]], [[-0.1, -0.2, -0.3]], ["stop"], [0], [prompt])
    multi = Rollouts([[1, 2]] * 2, [[6, 7], [8]], [[-0.5, 0.0], [-0.4]], ["stop"] * 2, [1, 1], [prompt] * 2,
                     loss_masks=[[1, 0], [1]])  # fmt: skip
    assert single.masks() == [[1, 1, 1]]
    joined = Rollouts.concat([single, multi])
    assert joined.loss_masks == [[1, 1, 1], [1, 0], [1]]
    assert joined.select([2, 1]).loss_masks == [[1], [1, 0]]
    assert Rollouts.concat([single, single]).loss_masks is None
    assert single.select([0]).response_ids == [[3, 4, 5]]


def _actor(model, **config):
    cfg = ActorConfig(max_tokens_per_microbatch=24, compute_dtype="float32", **config)
    cfg.optim.lr = 1e-2
    return Actor(model, cfg, total_steps=1, max_response_tokens=10, pad_token_id=0)


def _batch(mask_rows, masked_noise: float):
    """Two responses with a span the policy did not sample; `masked_noise` fills every per-token
    input of the loss (advantages, old / reference log-probs) at the masked positions."""
    prompts = [[5, 9, 200, 17], [44, 2, 7]]
    responses = [[21, 22, 23, 24, 25, 26], [31, 32, 33, 34]]
    mask = pad_ragged(mask_rows)
    noise = masked_noise * (1 - mask)
    advantages = T([[0.5], [-1.0]]) * mask + noise
    old = -0.7 * mask + noise
    ref = -0.9 * mask + noise
    return TrainingBatch(prompts, responses, mask, advantages=advantages, old_logprobs=old, ref_logprobs=ref)


def test_a_masked_span_has_no_gradient():
    """Whatever the loss's inputs hold at masked positions, the update is the same, to the bit (PPO
    clip, entropy bonus and KL loss on)."""
    base = from_hf_model(tiny_model("qwen2", seed=3))
    masks = [[1, 1, 0, 0, 1, 1], [1, 0, 1, 1]]

    def updated(batch, **config):
        model = copy.deepcopy(base)
        metrics = _actor(model, entropy_coeff=0.01, use_kl_loss=True, **config).update(batch)
        return model, metrics

    clean, m_clean = updated(_batch(masks, 0.0))
    noisy, m_noisy = updated(_batch(masks, 1e3))
    for (name, a), b in zip(clean.named_parameters(), noisy.parameters()):
        assert torch.equal(a, b), name
    assert m_clean == m_noisy
    # the masked tokens are not trained, but they are there: an all-ones mask trains on them
    ones, _ = updated(_batch([[1] * 6, [1] * 4], 0.0))
    assert not all(torch.equal(x, y) for x, y in zip(ones.parameters(), clean.parameters()))
