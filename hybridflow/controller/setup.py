"""Start-of-run checks and the step plan: everything is rejected or printed before the first step."""

from __future__ import annotations

import math

from hybridflow.algorithms.estimators import ESTIMATORS, estimator
from hybridflow.algorithms.kl import KL_ESTIMATORS
from hybridflow.algorithms.policy_losses import POLICY_LOSSES
from hybridflow.checkpoint import NO_CHECKPOINTS, writes_checkpoints
from hybridflow.config.schema import Config
from hybridflow.controller.async_checks import check_async
from hybridflow.controller.compatibility import refuse_incompatible
from hybridflow.controller.worker_group import worker_count
from hybridflow.devices import resolve_device
from hybridflow.errors import UserError, closest
from hybridflow.models.lora import lora_reference


def sequences_per_step(config: Config) -> int:
    return config.data.prompts_per_step * config.rollout.samples_per_prompt


def check_config(config: Config, workers: int | None = None) -> None:
    """Names that must exist, batch sizes that must divide (the arithmetic spelled out), and the
    features that do not combine yet (controller/compatibility.py) on `workers` training workers
    (default: what this machine gives the config)."""
    algo, actor = config.algorithm, config.actor
    if config.trainer.max_restarts and not writes_checkpoints(config.trainer.save_freq):
        raise UserError(
            f"trainer.max_restarts={config.trainer.max_restarts} starts a run again from its latest checkpoint, "
            f"and trainer.save_freq={config.trainer.save_freq} writes none (verl's 'never'): set save_freq to N "
            "(a checkpoint every N steps) or leave it unset"
        )
    for key, value, table in (
        ("algorithm.adv_estimator", algo.adv_estimator, ESTIMATORS),
        ("actor.policy_loss", actor.policy_loss, POLICY_LOSSES),
        ("actor.kl_loss_type", actor.kl_loss_type.rstrip("+"), KL_ESTIMATORS),
        ("algorithm.kl_penalty", algo.kl_penalty.rstrip("+"), KL_ESTIMATORS),
    ):
        if value not in table:
            raise UserError(
                f"config {key}={value!r} is unknown{closest(value, table)}; choose one of {', '.join(table)}"
            )
    check_async(config)
    if workers is None:  # the training workers: rollout workers hold only an engine
        workers = worker_count(config.resources, resolve_device(config.resources.device))
        workers -= config.resources.rollout_workers
    refuse_incompatible(config, workers)
    if config.rollout.exact_logprobs:
        from hybridflow.kernels.launch import supported

        device = resolve_device(config.resources.device)
        if not supported(device):
            raise UserError(
                f"rollout.exact_logprobs=true runs Triton kernels, on CUDA only, and this run is on {device.type}: "
                "run it on a GPU, or set rollout.exact_logprobs=false"
            )
        if config.model.compile:
            raise UserError(
                "rollout.exact_logprobs=true with model.compile=true: torch.compile rounds in its own way, "
                "the exact kernels in theirs; set model.compile=false"
            )
    per_step = sequences_per_step(config)
    per_update = actor.sequences_per_update
    if per_update is not None and (per_update <= 0 or per_step % per_update):
        raise UserError(
            f"actor.sequences_per_update={per_update} does not divide the {per_step} sequences of a step "
            f"(data.prompts_per_step={config.data.prompts_per_step} x "
            f"rollout.samples_per_prompt={config.rollout.samples_per_prompt})"
        )
    if config.critic.warmup_steps and not estimator(algo.adv_estimator).needs_critic:
        raise UserError(
            "critic.warmup_steps is set but algorithm.adv_estimator is not 'gae' (no critic is built)"
        )
    if (
        algo.filter_groups.enable
        and algo.filter_groups.metric == "seq_final_reward"
        and algo.use_kl_in_reward
    ):
        raise UserError(
            "algorithm.filter_groups.metric=seq_final_reward with a KL penalty in the reward is not supported "
            "(the penalty is known only after the reference pass); use seq_reward"
        )
    if config.reward.rule_weight == 0 and config.reward.model_path is None:
        raise UserError(
            "reward.rule_weight=0 (verl: reward_model.enable=True) leaves only a reward model, and none is "
            "set: give reward.model_path (verl: reward_model.model.path)"
        )
    if (
        config.reward.overlong_buffer.enable
        and config.reward.overlong_buffer.buffer_tokens >= config.data.max_response_tokens
    ):
        raise UserError(
            f"reward.overlong_buffer.buffer_tokens={config.reward.overlong_buffer.buffer_tokens} must be below "
            f"data.max_response_tokens={config.data.max_response_tokens}"
        )


def updates_per_step(config: Config) -> int:
    per_step = sequences_per_step(config)
    return math.ceil(per_step / (config.actor.sequences_per_update or per_step)) * config.actor.ppo_epochs


def step_plan(config: Config, total_steps: int, num_prompts: int, steps_per_epoch: int) -> str:
    c = config
    per_update = c.actor.sequences_per_update or sequences_per_step(c)
    return (
        f"step plan: {c.data.prompts_per_step} prompts x {c.rollout.samples_per_prompt} samples = "
        f"{sequences_per_step(c)} sequences per step | {updates_per_step(c)} optimizer update(s) per step "
        f"({per_update} sequences each, ppo_epochs={c.actor.ppo_epochs}) | micro-batch budget "
        f"{c.actor.max_tokens_per_microbatch} tokens | prompts <= {c.data.max_prompt_tokens} tokens, "
        f"responses <= {c.data.max_response_tokens} tokens | {total_steps} steps "
        f"({num_prompts} training prompts, {steps_per_epoch} steps per epoch) | "
        f"estimator {c.algorithm.adv_estimator}, policy loss {c.actor.policy_loss}, agg {c.actor.loss_agg_mode}"
        + (
            f" | each engine split over {c.rollout.tensor_parallel_size} workers (tensor parallel: no fused "
            "layers, generation is slower than a whole engine's)"
            if c.rollout.tensor_parallel_size > 1
            else ""
        )
        + (
            f" | experts split over groups of {c.actor.expert_parallel_size} workers (expert parallel)"
            if c.actor.expert_parallel_size > 1
            else ""
        )
        + ("" if writes_checkpoints(c.trainer.save_freq) else f" | {NO_CHECKPOINTS}")
        + (
            " | ref.offload_params has nothing to offload: with LoRA the reference is the policy's base "
            "with the adapters off"
            if c.ref.offload_params and lora_reference(c)
            else ""
        )
    )


def graded_sources(config: Config, reward_function=None) -> frozenset[str]:
    """The data sources whose rows the built-in scorers grade against a ground truth (none when a
    custom function, or a reward model alone, scores)."""
    from hybridflow.rewards.scorers import SCORERS

    builtin = reward_function is None and config.reward.custom_function_path is None
    rules = builtin and (config.reward.model_path is None or config.reward.rule_weight != 0)
    return frozenset(SCORERS) if rules else frozenset()


def check_environment(config: Config) -> None:
    """What this machine must have for the config, checked before any work: the GPUs asked for and
    the rollout backend's package."""
    import importlib.util

    import torch

    r = config.resources
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    asked = r.n_gpus_per_node
    if r.device != "cpu" and asked > 1 and r.nnodes == 1 and r.ray_address is None and asked > gpus:
        raise UserError(
            f"resources.n_gpus_per_node={asked} (verl: trainer.n_gpus_per_node) but this machine has "
            f"{gpus} CUDA GPU(s); ask for at most {max(gpus, 1)}"
            + (", or run on the CPU with resources.device=cpu resources.num_workers=N" if not gpus else "")
        )
    if r.device == "cuda" and not gpus:
        raise UserError("resources.device=cuda but no CUDA GPU is available; use resources.device=cpu")
    for sink, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if sink in config.trainer.logger and importlib.util.find_spec(package) is None:
            raise UserError(
                f"trainer.logger names {sink} but {package} is not installed: pip install {package} "
                "(or pip install hybridflow[tracking]), or drop it from trainer.logger"
            )
    if config.rollout.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError(
            "rollout.backend=vllm (verl: actor_rollout_ref.rollout.name=vllm) but vLLM is not installed: "
            "pip install vllm, or generate with the built-in engine (rollout.backend=native)"
        )


def run_prompts(config: Config, tokenizer, reward_function=None) -> tuple[list, list]:
    """The run's training and validation prompts (a built-in task's files written first; tokenized
    once and cached when data.cache_tokenized); a row without the ground truth its scorer grades is
    malformed (`reward_function`: a live function scored in this process)."""
    from hybridflow.data.prompts import load_prompts
    from hybridflow.data.tasks import use_task_files
    from hybridflow.models.default import cache_root

    c = config
    use_task_files(c)
    cache = cache_root(c.model.cache_dir) if c.data.cache_tokenized else None
    truth = graded_sources(c, reward_function)
    train = load_prompts(c.data.train_files, tokenizer, c.data, cache_root=cache, truth_sources=truth)
    val = []
    if c.data.val_files:
        val = load_prompts(c.data.val_files, tokenizer, c.data, cache_root=cache, truth_sources=truth)
        val = val[: c.data.max_val_prompts]
    return train, val
