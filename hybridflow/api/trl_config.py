"""TRL's config names (GRPOConfig, and the older PPOConfig of the tutorials) as our settings.

Each name either means what it means in TRL, converted to our keys and units, or is refused with
ours named. TRL counts optimizer steps where we count RL steps (one generation, then its updates):
with its batch fields the two differ by `updates per step`, and max_steps, save_steps and warmup_steps
are converted (a value that is not a whole number of our steps is refused).
"""

from __future__ import annotations

from typing import Any

from hybridflow.errors import UserError

LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}
SCHEDULERS = {
    "constant": "constant",
    "constant_with_warmup": "constant",
    "cosine": "cosine",
    "linear": "linear",
}
NO_EFFECT = {
    "logging_steps": "every step is logged",
    "log_completions": "a few completions go to RUN_DIR/samples.jsonl every trainer.log_samples_freq steps",
    "remove_unused_columns": "every column reaches the reward functions",
}


# TRL / transformers names with no field here: what to write instead (or why not)
NOT_HERE = {
    "num_generations_eval": "rollout={'val_samples_per_prompt': N}",
    "eval_strategy": "eval_steps=N (validation every N steps)",
    "save_strategy": "save_steps=N (a checkpoint every N steps; one is always written at the end)",
    "logging_dir": "output_dir (metrics.jsonl, TensorBoard's files under output_dir/tensorboard)",
    "run_name": "trainer={'experiment_name': NAME}",
    "optim": "AdamW only (learning_rate, weight_decay, adam_beta1/2)",
    "torch_compile": "model={'compile': True}",
    "use_liger_kernel": "nothing: the native model's LM head already computes log-probs in fused chunks",
    "use_liger_loss": "nothing: the native model's LM head already computes log-probs in fused chunks",
    "vllm_mode": "use_vllm=True (vLLM runs in-process, colocated) or the built-in engine (the default)",
    "vllm_gpu_memory_utilization": "rollout={'gpu_memory_utilization': F}",
    "push_to_hub": "trainer.save(DIR) (a transformers directory), then push it yourself",
    "per_device_eval_batch_size": "nothing: validation batches itself",
    "model_init_kwargs": "model={'dtype': ..., 'trust_remote_code': ...}",
    "sync_ref_model": "not supported: the reference stays the starting policy",
    "top_entropy_quantile": "not supported",
    "delta": "not supported (two-sided clipping); actor={'clip_ratio_c': C} is the dual-clip bound",
}


def unknown_names(cls_name: str, names: list[str], fields: list[str]) -> str:
    """One line for every keyword this config class does not take."""
    import difflib

    parts = []
    for name in names:
        if name in NOT_HERE:
            parts.append(f"{name}: {NOT_HERE[name]}")
        else:
            match = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
            parts.append(f"{name}: not a field{f' (did you mean {match[0]}?)' if match else ''}")
    return f"{cls_name} does not take " + "; ".join(parts)


def _whole(name: str, value: int, per_step: int) -> int:
    if value % per_step:
        raise UserError(
            f"{name}={value} counts optimizer updates and a step here makes {per_step}; give a multiple of {per_step}"
        )
    return value // per_step


def trl_settings(args: Any, samples_default: int) -> tuple[dict[str, Any], list[str]]:
    """Our dotted keys and values from the TRL-named fields set on `args` (an RLConfig), and notes
    on names accepted without effect."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    out: dict[str, Any] = {}
    notes = [f"{name} has no effect here: {why}" for name, why in NO_EFFECT.items() if get(name) is not None]

    samples = get("num_generations") or get("samples_per_prompt") or samples_default
    if get("num_generations") is not None:
        out["rollout.samples_per_prompt"] = get("num_generations")
    batch_fields = (
        "per_device_train_batch_size",
        "gradient_accumulation_steps",
        "generation_batch_size",
        "steps_per_generation",
    )
    updates = 1
    if any(get(f) is not None for f in batch_fields):
        per_update = (get("per_device_train_batch_size") or 8) * (get("gradient_accumulation_steps") or 1)
        generation = get("generation_batch_size") or (get("per_device_train_batch_size") or 8) * (
            get("steps_per_generation") or get("gradient_accumulation_steps") or 1
        )
        if generation % samples or generation % per_update:
            raise UserError(
                f"a generation batch of {generation} completions must hold whole groups of num_generations="
                f"{samples} and whole optimizer batches of {per_update} (per_device_train_batch_size x "
                "gradient_accumulation_steps)"
            )
        out["data.prompts_per_step"] = generation // samples
        out["actor.sequences_per_update"] = per_update
        updates = generation // per_update
    epochs = get("num_iterations") or get("ppo_epochs")
    if epochs is not None:
        out["actor.ppo_epochs"] = int(epochs)
    per_step = updates * int(epochs or 1)
    if get("max_steps") is not None and per_step > 1:
        out["trainer.total_training_steps"] = _whole("max_steps", get("max_steps"), per_step)
    if get("save_steps") is not None:
        out["trainer.save_freq"] = _whole("save_steps", get("save_steps"), per_step)
    if get("warmup_steps") is not None:
        out["actor.optim.warmup_steps"] = _whole("warmup_steps", get("warmup_steps"), per_step)
    if get("num_train_epochs") is not None:
        epochs_total = get("num_train_epochs")
        if float(epochs_total) != int(epochs_total):
            raise UserError(
                f"num_train_epochs={epochs_total}: give a whole number of passes over the prompts"
            )
        out["trainer.total_epochs"] = int(epochs_total)

    simple = {
        "max_completion_length": "data.max_response_tokens",
        "max_new_tokens": "data.max_response_tokens",
        "temperature": "rollout.temperature",
        "top_p": "rollout.top_p",
        "warmup_ratio": "actor.optim.warmup_ratio",
        "weight_decay": "actor.optim.weight_decay",
        "max_grad_norm": "actor.optim.grad_clip",
        "gradient_checkpointing": "model.enable_gradient_checkpointing",
        "shuffle_dataset": "data.shuffle",
        "chat_template_kwargs": "data.chat_template_kwargs",
        "eval_steps": "trainer.test_freq",
        "exp_name": "trainer.experiment_name",
        "cliprange_value": "critic.cliprange_value",
        "save_freq": "trainer.save_freq",
        "gamma": "algorithm.gamma",
        "lam": "algorithm.lam",
    }
    out |= {ours: get(name) for name, ours in simple.items() if get(name) is not None}
    if get("max_prompt_length") is not None:  # TRL cuts long prompts from the left
        out |= {"data.max_prompt_tokens": get("max_prompt_length"), "data.overlong_prompts": "truncate_left"}
    if get("top_k") is not None:
        out["rollout.top_k"] = get("top_k") or -1  # TRL's 0 disables top-k
    clip = get("epsilon") if get("epsilon") is not None else get("cliprange")
    if clip is not None:
        out |= {"actor.clip_ratio_low": clip, "actor.clip_ratio_high": clip}
    if get("epsilon_high") is not None:
        out["actor.clip_ratio_high"] = get("epsilon_high")
    if get("adam_beta1") is not None or get("adam_beta2") is not None:
        out["actor.optim.betas"] = [get("adam_beta1") or 0.9, get("adam_beta2") or 0.999]
    if get("batch_size") is not None:  # the tutorials' PPOConfig: sequences per step
        if get("batch_size") % samples:
            raise UserError(
                f"batch_size={get('batch_size')} must be a multiple of samples_per_prompt={samples}"
            )
        out["data.prompts_per_step"] = get("batch_size") // samples
    if get("mini_batch_size") is not None:
        out["actor.sequences_per_update"] = get("mini_batch_size")
    if get("vf_coef") is not None:
        notes.append("vf_coef has no effect here: the critic has its own optimizer (critic.optim.lr)")
    if get("loss_type") is not None:
        if get("loss_type") not in LOSS_TYPES:
            raise UserError(f"loss_type={get('loss_type')!r}: supported are {', '.join(LOSS_TYPES)}")
        out["actor.loss_agg_mode"] = LOSS_TYPES[get("loss_type")]
    scale = get("scale_rewards")
    if scale is not None:
        if scale in (True, "group"):
            out["algorithm.norm_adv_by_std_in_grpo"] = True
        elif scale in (False, "none"):
            out["algorithm.norm_adv_by_std_in_grpo"] = False
        else:
            raise UserError(
                f"scale_rewards={scale!r}: hybridflow scales by the group's std (group) or not (none)"
            )
    if get("lr_scheduler_type") is not None:
        if get("lr_scheduler_type") not in SCHEDULERS:
            raise UserError(
                f"lr_scheduler_type={get('lr_scheduler_type')!r}: supported are {', '.join(SCHEDULERS)}"
            )
        out["actor.optim.lr_scheduler"] = SCHEDULERS[get("lr_scheduler_type")]
    if get("report_to") is not None:
        names = [get("report_to")] if isinstance(get("report_to"), str) else list(get("report_to"))
        names = ["tensorboard", "wandb"] if names == ["all"] else [n for n in names if n != "none"]
        unknown = [n for n in names if n not in ("tensorboard", "wandb")]
        if unknown:
            raise UserError(f"report_to={unknown[0]!r}: hybridflow reports to tensorboard and wandb")
        out["trainer.logger"] = ["console", "jsonl", *names]
    if get("use_vllm"):
        out["rollout.backend"] = "vllm"
    if get("bf16"):
        out["actor.compute_dtype"] = "bfloat16"
    if get("mask_truncated_completions"):
        raise UserError(
            "mask_truncated_completions=True is not supported: truncated completions are trained on"
        )
    level = get("importance_sampling_level")
    if level is not None:
        if level not in ("token", "sequence"):
            raise UserError(f"importance_sampling_level={level!r}: token or sequence (GSPO)")
        out["actor.policy_loss"] = "vanilla" if level == "token" else "gspo"
    return out, notes
