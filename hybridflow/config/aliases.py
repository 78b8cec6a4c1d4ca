"""verl-style keys accepted as aliases of ours. The table is rendered in docs/config.md.

Most aliases are renames. One differs in units: verl's `ppo_mini_batch_size` counts *prompts* and is
silently multiplied by `rollout.n`; ours (`actor.sequences_per_update`) counts sequences, so the alias
is converted explicitly once the final samples_per_prompt is known (see `DEFERRED`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_ARR = "actor_rollout_ref"

# verl key -> our key
RENAMES: dict[str, str] = {
    f"{_ARR}.model.path": "model.path",
    f"{_ARR}.model.use_remove_padding": "model.use_remove_padding",
    f"{_ARR}.model.enable_gradient_checkpointing": "model.enable_gradient_checkpointing",
    f"{_ARR}.model.trust_remote_code": "model.trust_remote_code",
    f"{_ARR}.model.lora_rank": "model.lora_rank",
    f"{_ARR}.model.lora_alpha": "model.lora_alpha",
    f"{_ARR}.rollout.n": "rollout.samples_per_prompt",
    f"{_ARR}.rollout.temperature": "rollout.temperature",
    f"{_ARR}.rollout.top_p": "rollout.top_p",
    f"{_ARR}.rollout.top_k": "rollout.top_k",
    f"{_ARR}.rollout.gpu_memory_utilization": "rollout.gpu_memory_utilization",
    f"{_ARR}.rollout.free_cache_engine": "rollout.free_cache_engine",
    f"{_ARR}.rollout.name": "rollout.backend",
    f"{_ARR}.rollout.val_kwargs.n": "rollout.val_samples_per_prompt",
    f"{_ARR}.rollout.val_kwargs.temperature": "rollout.val_temperature",
    f"{_ARR}.actor.optim.lr": "actor.optim.lr",
    f"{_ARR}.actor.optim.weight_decay": "actor.optim.weight_decay",
    f"{_ARR}.actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    f"{_ARR}.actor.grad_clip": "actor.optim.grad_clip",
    f"{_ARR}.actor.ppo_micro_batch_size_per_gpu": "actor.sequences_per_microbatch",
    f"{_ARR}.actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_microbatch",
    f"{_ARR}.actor.ppo_epochs": "actor.ppo_epochs",
    f"{_ARR}.actor.clip_ratio_low": "actor.clip_ratio_low",
    f"{_ARR}.actor.clip_ratio_high": "actor.clip_ratio_high",
    f"{_ARR}.actor.clip_ratio_c": "actor.clip_ratio_c",
    f"{_ARR}.actor.loss_agg_mode": "actor.loss_agg_mode",
    f"{_ARR}.actor.use_kl_loss": "actor.use_kl_loss",
    f"{_ARR}.actor.kl_loss_coef": "actor.kl_loss_coef",
    f"{_ARR}.actor.kl_loss_type": "actor.kl_loss_type",
    f"{_ARR}.actor.entropy_coeff": "actor.entropy_coeff",
    f"{_ARR}.actor.ulysses_sequence_parallel_size": "actor.sequence_parallel_size",
    f"{_ARR}.actor.fsdp_config.param_offload": "actor.offload_params",
    f"{_ARR}.actor.fsdp_config.optimizer_offload": "actor.offload_optimizer",
    f"{_ARR}.ref.fsdp_config.param_offload": "ref.offload_params",
    f"{_ARR}.actor.policy_loss.loss_mode": "actor.policy_loss",
    "data.train_batch_size": "data.prompts_per_step",
    "data.max_prompt_length": "data.max_prompt_tokens",
    "data.max_response_length": "data.max_response_tokens",
    "train.total_training_steps": "trainer.total_training_steps",
    "trainer.default_local_dir": "trainer.run_dir",
    "trainer.resume_mode": "trainer.resume",
    "trainer.n_gpus_per_node": "resources.n_gpus_per_node",
    "trainer.nnodes": "resources.nnodes",
    "custom_reward_function.path": "reward.custom_function_path",
    "custom_reward_function.name": "reward.custom_function_name",
    "critic.optim.lr": "critic.optim.lr",
    "critic.cliprange_value": "critic.cliprange_value",
    "trainer.critic_warmup": "critic.warmup_steps",
}


def _clip_ratio_both(value: Any) -> dict[str, Any]:
    return {"actor.clip_ratio_low": value, "actor.clip_ratio_high": value}


def _logger(value: Any) -> dict[str, Any]:
    # verl calls the jsonl sink "file"
    names = [value] if isinstance(value, str) else list(value)
    return {"trainer.logger": ["jsonl" if n == "file" else n for n in names]}


# verl key -> function of its value giving our keys and values (same units)
EXPANSIONS: dict[str, Callable[[Any], dict[str, Any]]] = {
    f"{_ARR}.actor.clip_ratio": _clip_ratio_both,
    "trainer.logger": _logger,
}

# verl key -> (our key, conversion from the alias value and the resolved config as a plain dict)
DEFERRED: dict[str, tuple[str, Callable[[Any, dict], Any]]] = {
    f"{_ARR}.actor.ppo_mini_batch_size": (
        "actor.sequences_per_update",
        lambda prompts, cfg: int(prompts) * int(cfg["rollout"]["samples_per_prompt"]),
    ),
}


def all_alias_keys() -> list[str]:
    return [*RENAMES, *EXPANSIONS, *DEFERRED]
