"""TRL's GRPOConfig names (and the tutorials' PPOConfig) as our config, by hand-worked arithmetic."""

import pytest

from hybridflow import GRPOConfig, PPOConfig, RLOOConfig
from hybridflow.errors import UserError


def test_trl_grpo_names_mean_what_they_mean_in_trl():
    c = GRPOConfig(
        output_dir="runs/x", num_generations=4, max_completion_length=64, max_prompt_length=100, beta=0.04,
        epsilon=0.2, epsilon_high=0.28, loss_type="grpo", scale_rewards="none", temperature=0.9, top_k=0,
        learning_rate=2e-6, lr_scheduler_type="cosine", warmup_ratio=0.1, weight_decay=0.0, max_grad_norm=0.5,
        num_train_epochs=2, report_to="none", importance_sampling_level="sequence",
    ).to_config()  # fmt: skip
    assert (c.rollout.samples_per_prompt, c.data.max_response_tokens, c.data.max_prompt_tokens) == (
        4,
        64,
        100,
    )
    assert c.data.overlong_prompts == "truncate_left"  # TRL cuts long prompts from the left
    assert (c.actor.use_kl_loss, c.actor.kl_loss_coef, c.actor.kl_loss_type) == (True, 0.04, "low_var_kl")
    assert (c.actor.clip_ratio_low, c.actor.clip_ratio_high, c.actor.loss_agg_mode) == (
        0.2,
        0.28,
        "seq-mean-token-mean",
    )
    assert (c.algorithm.norm_adv_by_std_in_grpo, c.rollout.temperature, c.rollout.top_k) == (False, 0.9, -1)
    o = c.actor.optim
    assert (o.lr, o.lr_scheduler, o.warmup_ratio, o.weight_decay, o.grad_clip) == (
        2e-6,
        "cosine",
        0.1,
        0.0,
        0.5,
    )
    assert (c.trainer.total_epochs, c.trainer.logger, c.actor.policy_loss) == (
        2,
        ["console", "jsonl"],
        "gspo",
    )


def test_trl_batch_fields_become_prompts_and_updates_per_step():
    # 8 completions a device step x 4 accumulation = 32 per optimizer step; a generation of 8 x 8 = 64
    # completions holds 64 / 8 = 8 prompts of 8 samples and makes 2 optimizer steps
    c = GRPOConfig(num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                   steps_per_generation=8, max_steps=100, save_steps=50, warmup_steps=10).to_config()  # fmt: skip
    assert (c.data.prompts_per_step, c.actor.sequences_per_update) == (8, 32)
    assert (c.trainer.total_training_steps, c.trainer.save_freq, c.actor.optim.warmup_steps) == (50, 25, 5)
    with pytest.raises(UserError, match="max_steps=101 counts optimizer updates and a step here makes 2"):
        GRPOConfig(num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=4,
                   steps_per_generation=8, max_steps=101).to_config()  # fmt: skip
    with pytest.raises(UserError, match="whole groups of num_generations=3"):
        GRPOConfig(num_generations=3, per_device_train_batch_size=8).to_config()


def test_tutorial_ppo_names():
    c = PPOConfig(exp_name="tut", batch_size=16, mini_batch_size=4, ppo_epochs=2, kl_coef=0.05,
                  cliprange=0.1, cliprange_value=0.3, max_new_tokens=32, save_freq=5, gamma=0.99, lam=0.9).to_config()  # fmt: skip
    assert (c.data.prompts_per_step, c.actor.sequences_per_update, c.actor.ppo_epochs) == (16, 4, 2)
    assert (c.algorithm.use_kl_in_reward, c.algorithm.kl_ctrl.kl_coef) == (
        True,
        0.05,
    )  # PPO: KL in the reward
    assert (c.actor.clip_ratio_low, c.critic.cliprange_value, c.data.max_response_tokens) == (0.1, 0.3, 32)
    assert (c.trainer.experiment_name, c.trainer.run_dir, c.trainer.save_freq) == ("tut", "runs/tut", 5)
    assert (c.algorithm.gamma, c.algorithm.lam) == (0.99, 0.9)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eval_strategy": "steps"}, "eval_strategy: eval_steps=N"),
        ({"learnin_rate": 1e-6}, "learnin_rate: not a field (did you mean learning_rate?)"),
        ({"loss_type": "sapo"}, "loss_type='sapo': supported are grpo, bnpo, dapo, dr_grpo"),
        ({"scale_rewards": "batch"}, "scale_rewards='batch'"),
        ({"mask_truncated_completions": True}, "mask_truncated_completions=True is not supported"),
        (
            {"num_generations": 4, "samples_per_prompt": 4},
            "samples_per_prompt= and TRL's num_generations= both given",
        ),
        ({"num_train_epochs": 1.5}, "num_train_epochs=1.5: give a whole number"),
    ],
)
def test_names_that_do_not_apply_are_refused_naming_ours(kwargs, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        GRPOConfig(**kwargs).to_config()


def test_building_a_config_never_changes_the_presets():
    PPOConfig(batch_size=4, samples_per_prompt=2).to_config()
    again = PPOConfig(batch_size=4).to_config()
    assert (again.rollout.samples_per_prompt, again.data.prompts_per_step) == (1, 4)


def test_trl_class_names_resolve_what_is_left_unset_to_trls_defaults():
    """GRPOConfig / RLOOConfig given a few fields (or none) resolve the rest as TRL 1.16's classes
    do, not to hybridflow's defaults; the start note says where hybridflow keeps its own."""
    g = GRPOConfig(output_dir="runs/x")
    c = g.to_config()
    # TRL: 8 generations, 8 completions a device step and one update per generation -> 1 prompt
    assert (c.rollout.samples_per_prompt, c.data.prompts_per_step, c.trainer.total_epochs) == (8, 1, 3)
    assert (c.actor.use_kl_loss, c.actor.loss_agg_mode, c.data.max_response_tokens) == (
        False,
        "token-mean",
        512,
    )
    assert (c.actor.optim.lr, c.actor.optim.lr_scheduler, c.actor.optim.weight_decay) == (1e-6, "linear", 0.0)
    assert any("TRL's defaults, except bf16" in n for n in g.notes)
    r = RLOOConfig(output_dir="runs/x").to_config()
    assert (r.rollout.samples_per_prompt, r.data.prompts_per_step, r.trainer.total_epochs) == (2, 4, 3)
    assert (r.algorithm.use_kl_in_reward, r.algorithm.kl_ctrl.kl_coef, r.algorithm.kl_penalty) == (
        True,
        0.05,
        "kl",
    )
    assert not r.actor.use_kl_loss
    # what the caller gives wins, by either name; the section's value too
    c = GRPOConfig(num_generations=4, prompts_per_step=3, rollout={"temperature": 0.7}).to_config()
    assert (c.rollout.samples_per_prompt, c.data.prompts_per_step, c.rollout.temperature) == (4, 3, 0.7)
    assert GRPOConfig(samples_per_prompt=2).to_config().data.prompts_per_step == 4  # 8 completions
    assert GRPOConfig(rollout={"samples_per_prompt": 4}).to_config().data.prompts_per_step == 2
    # a recipe is the base: TRL's defaults do not override it
    d = GRPOConfig(recipe="demo_arithmetic_grpo").to_config()
    assert (d.rollout.samples_per_prompt, d.data.prompts_per_step) == (8, 4)


def test_rloo_beta_is_a_kl_penalty_in_the_reward_as_in_trl():
    """TRL's RLOO subtracts beta x (the sequence's summed k1 KL) from its reward before the
    leave-one-out baseline. Worked by hand: rewards 1 and 0, KL sums 0.5 and 0.1, beta 0.2 ->
    penalised 0.9 and -0.02 -> advantages 0.92 and -0.92."""
    import torch

    from hybridflow.algorithms.kl import kl_penalty
    from hybridflow.controller.advantage import compute_advantages, token_level_rewards

    c = RLOOConfig(beta=0.2).to_config()
    assert (c.algorithm.use_kl_in_reward, c.algorithm.kl_ctrl.kl_coef, c.actor.use_kl_loss) == (
        True,
        0.2,
        False,
    )
    mask = torch.ones(2, 2)
    old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.25, -1.25], [-1.05, -1.05]])  # k1 per token 0.25 / 0.05: sums 0.5 / 0.1
    kl = kl_penalty(old, ref, c.algorithm.kl_penalty) * mask
    rewards = token_level_rewards(torch.tensor([1.0, 0.0]), mask) - c.algorithm.kl_ctrl.kl_coef * kl
    adv, _ = compute_advantages(c.algorithm, token_rewards=rewards, mask=mask, group_ids=[0, 0])
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.92, -0.92]))
