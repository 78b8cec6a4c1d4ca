"""verl's keys, one entry each: what it becomes here, or why it has no effect, or why it is refused.

Every key of verl's quickstart, its GRPO and PPO example scripts and its DAPO recipe is in `VERL`
(tests/cpu/test_verl_keys.py walks the table; docs/config.md renders it). An entry is a rule from the
key's value to a `Translation`: our keys and values (same units unless its doc says how it converts),
a note (accepted, no effect here: printed at start), or a refusal (one line naming what to do).

Three keys depend on others and are resolved after all the rest (`DEFERRED`): verl's
`ppo_mini_batch_size` counts *prompts* and is multiplied by `rollout.n` whatever the order of keys;
`val_kwargs.do_sample=False` makes validation greedy whatever its temperature; and `truncation` only
matters for prompts that `filter_overlong_prompts` kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridflow.config import verl_async
from hybridflow.config import verl_rules as r
from hybridflow.config.verl_rules import Entry, Translation, by_value, no_effect, refused, rename

_ARR = "actor_rollout_ref"
SAME_SP = r.SAME_SP
SAME_TP_EP = r.SAME_TP_EP


VERL: dict[str, Entry] = {
    # model
    f"{_ARR}.model.path": rename("model.path"),
    f"{_ARR}.model.use_remove_padding": rename(
        "model.use_remove_padding", "the native model is always padding-free"
    ),
    f"{_ARR}.model.enable_gradient_checkpointing": rename("model.enable_gradient_checkpointing"),
    f"{_ARR}.model.trust_remote_code": rename("model.trust_remote_code"),
    f"{_ARR}.model.lora_rank": rename(
        "model.lora_rank",
        "LoRA on the native model (or PEFT's on the transformers path); verl's `target_modules: all-linear` is our default `model.lora_target_modules`",
    ),
    f"{_ARR}.model.lora_alpha": rename("model.lora_alpha"),
    f"{_ARR}.model.lora_adapter_path": rename("model.lora_adapter_path"),
    f"{_ARR}.model.use_fused_kernels": no_effect(
        "the native model's LM head always computes log-probs in fused chunks"
    ),
    f"{_ARR}.model.fused_kernel_options.impl_backend": no_effect(
        "the native model's LM head always computes log-probs in fused chunks"
    ),
    f"{_ARR}.model.use_shm": no_effect("models load from local files"),
    f"{_ARR}.model.override_config.attention_dropout": by_value(
        r.dropout,
        "(no effect at 0)",
        "the native model has no dropout: 0 is accepted, other values refused",
    ),
    f"{_ARR}.model.override_config.embd_pdrop": by_value(
        r.dropout, "(no effect at 0)", "as attention_dropout"
    ),
    f"{_ARR}.model.override_config.max_position_embeddings": no_effect(
        "nothing here is limited by it: positions are rotary, the context is data.max_prompt_length + max_response_length"
    ),
    f"{_ARR}.model.override_config.resid_pdrop": by_value(
        r.dropout, "(no effect at 0)", "as attention_dropout"
    ),
    # rollout
    f"{_ARR}.rollout.n": rename("rollout.samples_per_prompt"),
    f"{_ARR}.rollout.temperature": rename(
        "rollout.temperature",
        "as in verl, the actor's and reference's log-probs are of softmax(logits / temperature), the distribution the rollout samples from (top-k/top-p truncation is not part of the policy)",
    ),
    f"{_ARR}.rollout.top_p": rename("rollout.top_p"),
    f"{_ARR}.rollout.top_k": rename("rollout.top_k"),
    f"{_ARR}.rollout.gpu_memory_utilization": rename(
        "rollout.gpu_memory_utilization",
        "ours is the share of the GPU memory free when the engine starts that its KV pool may take (vLLM's: of the whole GPU, weights included); memory, not results",
    ),
    f"{_ARR}.rollout.free_cache_engine": rename("rollout.free_cache_engine"),
    f"{_ARR}.rollout.name": by_value(
        r.rollout_name,
        "`rollout.backend`",
        "`vllm`, `hf` and `native` (the built-in engine); `sglang` runs on the built-in engine (said at start: the same sampling, continuous batching and prefix cache); trtllm is refused. vLLM must be installed: the start checks it before any work",
    ),
    f"{_ARR}.rollout.max_num_seqs": rename("rollout.max_batch_sequences"),
    f"{_ARR}.rollout.max_num_batched_tokens": rename(
        "rollout.max_prefill_tokens", "the engine's token budget of one prefill step"
    ),
    f"{_ARR}.rollout.enable_prefix_caching": rename(
        "rollout.prefix_cache",
        "the built-in engine's prefix cache across requests (on by default, as verl's)",
    ),
    f"{_ARR}.rollout.enable_chunked_prefill": no_effect(
        "the built-in engine splits prefills by its token budget (rollout.max_prefill_tokens)"
    ),
    f"{_ARR}.rollout.tensor_model_parallel_size": no_effect(
        "each GPU runs its own engine replica; results are the same, memory per GPU is not (`hybridflow plan`); "
        "rollout.tensor_parallel_size splits it (over the actor's TP groups or groups of its own; CUDA graphs, "
        "not the fused layers: slower than a whole engine where one fits)"
    ),
    f"{_ARR}.rollout.log_prob_micro_batch_size_per_gpu": no_effect(r.MICRO),
    f"{_ARR}.rollout.log_prob_use_dynamic_bsz": no_effect(r.DYNAMIC),
    f"{_ARR}.rollout.calculate_log_probs": no_effect(
        "the engine always returns the log-probs of the tokens it samples"
    ),
    f"{_ARR}.rollout.log_prob_max_token_len_per_gpu": no_effect(
        "the old-policy log-probs use actor.max_tokens_per_microbatch"
    ),
    f"{_ARR}.rollout.mode": no_effect(
        "rollouts, single- and multi-turn, are the same in verl's sync and async modes; the engine batches requests continuously and runs every episode as its own task"
    ),
    f"{_ARR}.rollout.load_format": no_effect(
        "the engine receives the actor's weights in place at the first sync"
    ),
    f"{_ARR}.rollout.layered_summon": no_effect(
        "weights always reach the engine one decoder layer at a time"
    ),
    f"{_ARR}.hybrid_engine": by_value(
        r.hybrid_engine,
        "(no effect when True)",
        "True: the engine shares the training GPUs (our default); False needs `rollout.n_gpus_per_node`, the engine's own GPUs",
    ),
    f"{_ARR}.rollout.multi_stage_wake_up": no_effect("an SGLang option; SGLang is not used"),
    f"{_ARR}.rollout.over_sample_rate": no_effect(
        "no request is aborted early: every response of a step is generated to its end"
    ),
    # multi-turn (verl's ToolAgentLoop): rollout.agent
    f"{_ARR}.rollout.multi_turn.enable": by_value(
        r.multi_turn_enable,
        "`rollout.agent.loop`",
        "True: tool-calling episodes (`rollout.agent.loop=tools`)",
    ),
    f"{_ARR}.rollout.multi_turn.tool_config_path": by_value(
        r.unless_null("rollout.agent.tool_config"),
        "`rollout.agent.tool_config`",
        "verl's tool YAML as it is: SandboxFusionTool runs in our code sandbox, Gsm8kTool checks answers; other classes are verl code and refused",
    ),
    f"{_ARR}.rollout.multi_turn.max_assistant_turns": by_value(
        r.assistant_turns, "`rollout.agent.max_turns`", "null: no limit but the response length"
    ),
    f"{_ARR}.rollout.multi_turn.max_user_turns": by_value(
        r.unless_null("rollout.agent.max_tool_turns", int), "`rollout.agent.max_tool_turns`", "null: no limit"
    ),
    f"{_ARR}.rollout.multi_turn.max_parallel_calls": by_value(
        r.unless_null("rollout.agent.max_parallel_calls", int),
        "`rollout.agent.max_parallel_calls`",
        "calls past it are answered with an error, where verl drops them unanswered",
    ),
    f"{_ARR}.rollout.multi_turn.max_tool_response_length": by_value(
        r.unless_null("rollout.agent.max_tool_output_chars", int),
        "`rollout.agent.max_tool_output_chars`",
        "characters, as in verl",
    ),
    f"{_ARR}.rollout.multi_turn.tool_response_truncate_side": by_value(
        r.truncate_side,
        "`rollout.agent.tool_output_keep`",
        "left / right / middle keep the start / the end / both ends",
    ),
    f"{_ARR}.rollout.multi_turn.format": by_value(
        r.tool_format,
        "`rollout.agent.tool_format`",
        "hermes (and SGLang's qwen / qwen25, the same format), llama3_json (as `llama3`), mistral",
    ),
    f"{_ARR}.rollout.multi_turn.interaction_config_path": by_value(
        r.interaction,
        "(refused unless null)",
        "verl interactions run only inside verl: write an environment (reset(sample), step(action)) for `rollout.agent.environment`",
    ),
    f"{_ARR}.rollout.multi_turn.use_inference_chat_template": no_effect(
        "episodes keep the tokens the model sampled, never re-rendered; a template that rewrites history starts a new segment (agent/segments_mean)"
    ),
    f"{_ARR}.rollout.multi_turn.tokenization_sanity_check_mode": no_effect(
        "every turn's tokens are checked against the template's rendering of the whole conversation; a mismatch starts a new segment"
    ),
    f"{_ARR}.rollout.multi_turn.num_repeat_rollouts": no_effect(
        "rollout.n episodes per prompt form its group"
    ),
    f"{_ARR}.rollout.agent.num_workers": no_effect(
        "every episode of a step runs as an asyncio task on one continuously batched engine"
    ),
    f"{_ARR}.rollout.engine_kwargs.vllm.swap_space": no_effect("vLLM engine options are not passed through"),
    f"{_ARR}.rollout.engine_kwargs.sglang.attention_backend": no_effect("SGLang is not used"),
    f"{_ARR}.rollout.val_kwargs.n": rename("rollout.val_samples_per_prompt"),
    f"{_ARR}.rollout.val_kwargs.temperature": rename(
        "rollout.val_temperature",
        "greedy unless `val_kwargs.do_sample=True` (verl's rule, applied whatever the order of keys)",
    ),
    f"{_ARR}.rollout.val_kwargs.top_p": rename("rollout.val_top_p", convert=float),
    f"{_ARR}.rollout.val_kwargs.top_k": rename("rollout.val_top_k", convert=int),
    f"{_ARR}.rollout.val_kwargs.do_sample": by_value(
        lambda v: Translation(),
        "(see note)",
        "False (verl's default) makes validation greedy whatever `val_kwargs.temperature` says; True samples at it",
    ),
    # actor
    f"{_ARR}.actor.strategy": by_value(
        r.strategy("actor"), "(no effect)", "fsdp / fsdp2 accepted (FSDP2 always); megatron refused"
    ),
    f"{_ARR}.actor.optim.lr": rename("actor.optim.lr"),
    f"{_ARR}.actor.optim.weight_decay": rename("actor.optim.weight_decay"),
    f"{_ARR}.actor.optim.lr_warmup_steps": by_value(
        r.warmup_steps,
        "`actor.optim.warmup_steps`",
        "training steps, as in verl (the schedule moves once per step, not per mini-batch); -1 (verl's default) leaves `lr_warmup_steps_ratio` in charge",
    ),
    f"{_ARR}.actor.optim.lr_warmup_steps_ratio": rename(
        "actor.optim.warmup_ratio", "a fraction of the run's training steps"
    ),
    f"{_ARR}.actor.grad_clip": rename("actor.optim.grad_clip"),
    f"{_ARR}.actor.ppo_micro_batch_size_per_gpu": rename(
        "actor.sequences_per_microbatch", "a cap on sequences per micro-batch; changes memory, not results"
    ),
    f"{_ARR}.actor.ppo_max_token_len_per_gpu": rename("actor.max_tokens_per_microbatch"),
    f"{_ARR}.actor.use_dynamic_bsz": no_effect(r.DYNAMIC),
    f"{_ARR}.actor.ppo_epochs": rename("actor.ppo_epochs"),
    f"{_ARR}.actor.clip_ratio_low": rename("actor.clip_ratio_low"),
    f"{_ARR}.actor.clip_ratio_high": rename("actor.clip_ratio_high"),
    f"{_ARR}.actor.clip_ratio_c": rename("actor.clip_ratio_c"),
    f"{_ARR}.actor.clip_ratio": by_value(
        lambda v: Translation({"actor.clip_ratio_low": v, "actor.clip_ratio_high": v}),
        "`actor.clip_ratio_low` and `actor.clip_ratio_high`",
        "sets both",
    ),
    f"{_ARR}.actor.loss_agg_mode": rename("actor.loss_agg_mode"),
    f"{_ARR}.actor.use_token_level_loss": by_value(
        r.token_level_loss,
        "`actor.loss_agg_mode`",
        "older verl: True is token-mean, False seq-mean-token-mean",
    ),
    f"{_ARR}.actor.use_kl_loss": rename("actor.use_kl_loss"),
    f"{_ARR}.actor.kl_loss_coef": rename("actor.kl_loss_coef"),
    f"{_ARR}.actor.kl_loss_type": rename("actor.kl_loss_type"),
    f"{_ARR}.actor.entropy_coeff": rename("actor.entropy_coeff"),
    f"{_ARR}.actor.router_replay.mode": rename("actor.router_replay", "R2 and R3"),
    f"{_ARR}.actor.megatron.router_replay.mode": rename(
        "actor.router_replay", "R2 and R3 in our trainer (no Megatron)"
    ),
    f"{_ARR}.actor.megatron.tensor_model_parallel_size": rename(
        "actor.tensor_parallel_size",
        "consecutive workers split each layer, FSDP2 over the groups (with strategy fsdp: megatron itself is refused)",
        convert=int,
    ),
    f"{_ARR}.actor.megatron.expert_model_parallel_size": rename(
        "actor.expert_parallel_size",
        "groups of consecutive training workers, their experts' gradients summed across the groups",
        convert=int,
    ),
    f"{_ARR}.actor.megatron.pipeline_model_parallel_size": by_value(
        r.pipeline_parallel,
        "(no effect at 1)",
        "1 accepted; more is refused (pipeline parallelism is not built)",
    ),
    f"{_ARR}.actor.megatron.use_dist_checkpointing": no_effect(r.NO_DIST_CKPT),
    f"{_ARR}.actor.megatron.dist_checkpointing_path": no_effect(r.NO_DIST_CKPT),
    f"{_ARR}.ref.megatron.tensor_model_parallel_size": by_value(
        r.same_as_actor("_tp.ref"), "(must equal the actor's)", r.SAME_TP_EP
    ),
    f"{_ARR}.ref.megatron.expert_model_parallel_size": by_value(
        r.same_as_actor("_ep.ref"), "(must equal the actor's)", r.SAME_TP_EP
    ),
    f"{_ARR}.ref.megatron.pipeline_model_parallel_size": by_value(
        r.pipeline_parallel,
        "(no effect at 1)",
        "1 accepted; more is refused (pipeline parallelism is not built)",
    ),
    f"{_ARR}.ref.megatron.use_dist_checkpointing": no_effect(r.NO_DIST_CKPT),
    f"{_ARR}.ref.megatron.dist_checkpointing_path": no_effect(r.NO_DIST_CKPT),
    f"{_ARR}.rollout.enable_rollout_routing_replay": no_effect(
        "our engine records the routes whenever `actor.router_replay=R3` (the actor's mode decides)"
    ),
    f"{_ARR}.actor.ulysses_sequence_parallel_size": rename(
        "actor.sequence_parallel_size", "applies to actor, reference and critic alike"
    ),
    f"{_ARR}.actor.fsdp_config.param_offload": rename(
        "actor.offload_params",
        "FSDP2 CPU offload: weights, gradients and Adam in CPU memory, the step on the CPU",
    ),
    f"{_ARR}.actor.fsdp_config.optimizer_offload": rename(
        "actor.offload_optimizer", "Adam's state in CPU memory outside the update"
    ),
    f"{_ARR}.actor.fsdp_config.model_dtype": rename(
        "model.dtype", "fp32 / bf16 / fp16 as float32 / bfloat16 / float16", convert=r.dtype
    ),
    f"{_ARR}.actor.fsdp_config.fsdp_size": by_value(
        r.fsdp_size,
        "(no effect)",
        "FSDP2 shards over all training workers whatever the size (hybrid sharding changes memory and communication, not results)",
    ),
    f"{_ARR}.actor.policy_loss.loss_mode": rename("actor.policy_loss"),
    f"{_ARR}.actor.profiler.enable": no_effect(r.PROFILE),
    f"{_ARR}.actor.profiler.ranks": no_effect(r.PROFILE),
    f"{_ARR}.actor.profiler.all_ranks": no_effect(r.PROFILE),
    # reference
    f"{_ARR}.ref.strategy": by_value(r.strategy("reference"), "(no effect)", "as actor.strategy"),
    f"{_ARR}.ref.fsdp_config.param_offload": rename("ref.offload_params"),
    f"{_ARR}.ref.log_prob_micro_batch_size_per_gpu": no_effect(r.MICRO),
    f"{_ARR}.ref.log_prob_use_dynamic_bsz": no_effect(r.DYNAMIC),
    f"{_ARR}.ref.log_prob_max_token_len_per_gpu": rename("ref.max_tokens_per_microbatch"),
    f"{_ARR}.ref.ulysses_sequence_parallel_size": by_value(
        lambda v: Translation({"_sp.ref": int(v)}), "(must equal the actor's)", r.SAME_SP
    ),
    # critic
    "critic.strategy": by_value(r.strategy("critic"), "(no effect)", "as actor.strategy"),
    "critic.model.path": rename("critic.model_path", "`default` is the embedded model, as for model.path"),
    "critic.model.use_remove_padding": no_effect("the native model is always padding-free"),
    "critic.model.enable_gradient_checkpointing": no_effect(
        "model.enable_gradient_checkpointing applies to every trained model"
    ),
    "critic.model.fsdp_config.param_offload": no_effect(
        "the critic is not offloaded; `hybridflow plan` shows its memory"
    ),
    "critic.model.fsdp_config.optimizer_offload": no_effect(
        "the critic is not offloaded; `hybridflow plan` shows its memory"
    ),
    "critic.optim.lr": rename("critic.optim.lr"),
    "critic.optim.lr_warmup_steps_ratio": rename(
        "critic.optim.warmup_ratio", "a fraction of the run's training steps"
    ),
    "critic.ppo_micro_batch_size_per_gpu": no_effect(
        "the critic's micro-batches are packed to critic.max_tokens_per_microbatch, which changes memory, not results"
    ),
    "critic.ppo_max_token_len_per_gpu": rename("critic.max_tokens_per_microbatch"),
    "critic.use_dynamic_bsz": no_effect(r.DYNAMIC),
    "critic.cliprange_value": rename("critic.cliprange_value"),
    "critic.ulysses_sequence_parallel_size": by_value(
        lambda v: Translation({"_sp.critic": int(v)}), "(must equal the actor's)", r.SAME_SP
    ),
    "critic.profiler.enable": no_effect(r.PROFILE),
    "critic.profiler.ranks": no_effect(r.PROFILE),
    "critic.profiler.all_ranks": no_effect(r.PROFILE),
    # data
    "data.train_batch_size": rename("data.prompts_per_step"),
    "data.max_prompt_length": rename("data.max_prompt_tokens"),
    "data.max_response_length": rename("data.max_response_tokens"),
    "data.gen_batch_size": rename(
        "algorithm.filter_groups.prompts_per_round", "DAPO: prompts sampled per generation round"
    ),
    "data.filter_overlong_prompts": by_value(
        lambda v: Translation(),
        "`data.overlong_prompts`",
        "True: `filter`; False: what `data.truncation` says",
    ),
    "data.truncation": by_value(
        lambda v: Translation(),
        "`data.overlong_prompts`",
        "error / left / right, applied to the prompts that filtering kept (`error`, `truncate_left`, `truncate_right`); `middle` refused",
    ),
    "data.return_raw_chat": no_effect("prompts keep their chat messages"),
    "data.custom_cls.path": refused(
        "verl's dataset classes run only inside verl: give files whose rows hold prompt (chat messages), "
        "data_source and reward_model.ground_truth, verl's schema (`hybridflow data preprocess` makes them "
        "for GSM8K and MATH)"
    ),
    "data.custom_cls.name": refused("see data.custom_cls.path"),
    "data.apply_chat_template_kwargs.reasoning_effort": rename(
        "data.chat_template_kwargs.reasoning_effort", "passed to the tokenizer's chat template"
    ),
    "data.apply_chat_template_kwargs.enable_thinking": rename(
        "data.chat_template_kwargs.enable_thinking", "passed to the tokenizer's chat template"
    ),
    # algorithm
    "algorithm.filter_groups.metric": by_value(
        lambda v: Translation({"algorithm.filter_groups.metric": v}),
        "`algorithm.filter_groups.metric`",
        "acc (the function's `acc`, else its score), score, seq_reward (score after shaping), seq_final_reward (after a KL penalty in the reward too)",
    ),
    "algorithm.filter_groups.max_num_gen_batches": by_value(
        r.max_gen_batches,
        "`algorithm.filter_groups.max_generation_rounds`",
        "positive limits; at the limit hybridflow trains on the groups it kept (verl raises)",
    ),
    "algorithm.use_pf_ppo": by_value(r.pf_ppo, "(refused when True)", "PF-PPO is not implemented"),
    "algorithm.pf_ppo.reweight_method": refused("PF-PPO is not implemented in hybridflow"),
    "algorithm.pf_ppo.weight_pow": refused("PF-PPO is not implemented in hybridflow"),
    # reward
    "custom_reward_function.path": rename("reward.custom_function_path"),
    "custom_reward_function.name": rename("reward.custom_function_name"),
    "custom_reward_function.overlong_buffer.enable": rename("reward.overlong_buffer.enable"),
    "custom_reward_function.overlong_buffer.len": rename("reward.overlong_buffer.buffer_tokens"),
    "custom_reward_function.overlong_buffer.penalty_factor": rename("reward.overlong_buffer.penalty_factor"),
    "reward_model.overlong_buffer.enable": rename("reward.overlong_buffer.enable"),
    "reward_model.overlong_buffer.len": rename("reward.overlong_buffer.buffer_tokens"),
    "reward_model.overlong_buffer.penalty_factor": rename("reward.overlong_buffer.penalty_factor"),
    # verl's DAPO reward manager's own spelling of the same (its fully_async and newer DAPO scripts)
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": rename("reward.overlong_buffer.enable"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": rename("reward.overlong_buffer.buffer_tokens"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": rename(
        "reward.overlong_buffer.penalty_factor"
    ),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": no_effect(
        "the overlong penalty is always in the metrics (reward/overlong_penalty)"
    ),
    "reward_model.reward_kwargs.max_resp_len": by_value(
        lambda v: Translation(),
        "(checked)",
        "must equal `data.max_response_length`: the penalty is measured from it",
    ),
    "reward_model.reward_manager": by_value(
        r.only(
            lambda v: v in ("naive", "batch", "prime", "dapo"),
            "rule rewards always score in hybridflow's process pool (reward.num_workers) with timeouts; DAPO's overlong shaping follows reward_model.overlong_buffer",
            "reward_model.reward_manager={v!r}: hybridflow scores in its process pool (naive, batch, prime, dapo accepted)",
        ),
        "(no effect)",
        "naive / batch / prime / dapo: scoring always runs in the process pool",
    ),  # fmt: skip
    "reward_model.enable": by_value(
        r.reward_model_enable,
        "`reward.rule_weight=0`",
        "True: the reward model's score replaces the rule reward, as in verl",
    ),
    "reward_model.model.path": rename(
        "reward.model_path", "scored only when `reward_model.enable=True` (as in verl)"
    ),
    "reward_model.model.use_remove_padding": no_effect("the native model is always padding-free"),
    "reward_model.model.fsdp_config.param_offload": no_effect("the reward model is not offloaded"),
    "reward_model.micro_batch_size_per_gpu": no_effect(
        "the reward model's micro-batches are packed to reward.model_max_tokens_per_microbatch"
    ),
    "reward_model.num_workers": rename("reward.num_workers"),
    "reward_model.use_reward_loop": no_effect(
        "rewards are scored in the trainer's process pool (and the reward model in the trainer)"
    ),
    "reward_model.rollout.name": refused(
        "a reward model served by a rollout engine (verl's reward loop) is not supported: hybridflow scores reward_model.model.path as a sequence classifier"
    ),
    "reward_model.rollout.tensor_model_parallel_size": refused(
        "a reward model served by a rollout engine (verl's reward loop) is not supported"
    ),
    "reward_model.rollout.gpu_memory_utilization": refused(
        "a reward model served by a rollout engine (verl's reward loop) is not supported"
    ),
    "reward_model.rollout.prompt_length": refused(
        "a reward model served by a rollout engine (verl's reward loop) is not supported"
    ),
    "reward_model.rollout.response_length": refused(
        "a reward model served by a rollout engine (verl's reward loop) is not supported"
    ),
    "reward_model.sandbox_fusion.url": no_effect(
        "code runs in hybridflow's local sandbox (data_source code), not a SandboxFusion server"
    ),
    "reward_model.sandbox_fusion.max_concurrent": no_effect(
        "code runs in hybridflow's local sandbox, reward.num_workers at a time"
    ),
    # trainer
    "train.total_training_steps": rename("trainer.total_training_steps"),
    "trainer.default_local_dir": rename("trainer.run_dir"),
    "trainer.resume_mode": by_value(
        r.resume_mode,
        "`trainer.resume`",
        "auto / disable; resume_path refused with the way to start from a checkpoint",
    ),
    "trainer.n_gpus_per_node": rename(
        "resources.n_gpus_per_node", "must be GPUs this machine has: the start checks"
    ),
    "trainer.nnodes": rename("resources.nnodes"),
    "trainer.critic_warmup": rename("critic.warmup_steps"),
    "trainer.logger": by_value(r.logger, "`trainer.logger`", "verl's `file` sink is our `jsonl`"),
    "trainer.use_legacy_worker_impl": no_effect("hybridflow has one worker implementation"),
    "global_profiler.tool": no_effect(r.PROFILE),
    "global_profiler.steps": no_effect(r.PROFILE),
    "global_profiler.profile_continuous_steps": no_effect(r.PROFILE),
    "global_profiler.global_tool_config.nsys.discrete": no_effect(r.PROFILE),
    "global_profiler.save_path": no_effect(r.PROFILE),
    "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries": no_effect(r.PROFILE),
    "global_profiler.global_tool_config.torch_memory.stack_depth": no_effect(r.PROFILE),
    # the engine on GPUs of its own: verl's one_step_off_policy and fully_async_policy recipes
    **verl_async.ENTRIES,
}


def _mini_batch(value: Any, config: dict[str, Any]) -> dict[str, Any]:
    # verl counts prompts and multiplies by rollout.n itself
    return {"actor.sequences_per_update": int(value) * int(config["rollout"]["samples_per_prompt"])}


def _do_sample(value: Any, config: dict[str, Any]) -> dict[str, Any]:
    return {} if r.truthy(value) else {"rollout.val_temperature": 0.0}


def overlong_setting(filter_value: Any, truncation: Any) -> tuple[dict[str, Any], str | None]:
    if r.truthy(filter_value):
        return {"data.overlong_prompts": "filter"}, None
    modes = {"error": "error", "left": "truncate_left", "right": "truncate_right"}
    if truncation not in modes:
        return {}, f"data.truncation={truncation!r}: supported are error, left, right"
    return {"data.overlong_prompts": modes[truncation]}, None


# verl key -> our keys and values, from its value and the config resolved without it (a nested dict)
DEFERRED: dict[str, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {
    f"{_ARR}.actor.ppo_mini_batch_size": _mini_batch,
    f"{_ARR}.rollout.val_kwargs.do_sample": _do_sample,
}
DEFERRED_DOCS = {
    f"{_ARR}.actor.ppo_mini_batch_size": (
        "`actor.sequences_per_update`",
        "**units differ**: verl counts prompts and multiplies by `rollout.n` internally; we count "
        "sequences, so the value is converted to `value x rollout.samples_per_prompt` (the final `n`, whatever the order of keys)",
    ),
}


# verl keys of a free-form mapping: each entry of theirs is an entry of ours
MAPPING_PREFIXES = {"custom_reward_function.reward_kwargs": "reward.custom_function_kwargs"}


def all_alias_keys() -> list[str]:
    return [*VERL, *DEFERRED]


def markdown_table() -> str:
    """The table of docs/config.md (a test checks the page holds it as rendered here)."""
    rows = ["| verl key | hybridflow | note |", "| --- | --- | --- |"]
    for key, entry in VERL.items():
        rows.append(f"| `{key}` | {entry.ours} | {entry.doc} |")
    for key, (ours, doc) in DEFERRED_DOCS.items():
        rows.append(f"| `{key}` | {ours} | {doc} |")
    return "\n".join(rows)
