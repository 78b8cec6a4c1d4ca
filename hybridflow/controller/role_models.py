"""Which model each role runs and which backend generates: ours (packed) where the family is
supported, transformers otherwise; the rollout engine, transformers generate or vLLM."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hybridflow.config.schema import Config
from hybridflow.controller.setup import sequences_per_step
from hybridflow.errors import UserError
from hybridflow.models import native, save_hf, stop_token_ids
from hybridflow.models.lora import (
    apply_lora,
    load_adapter,
    lora_modules,
    merged_model,
    peft_lora_config,
    read_adapter_config,
)
from hybridflow.models.native.model import exact_kernels_refusal
from hybridflow.roles.critic import load_value_model, value_model_from_policy
from hybridflow.rollout.hf import HFBackend


def policy_model(config: Config, hf_model):
    """The model the actor trains: ours (padding-free) for model.impl native/auto when the family is
    supported, else the transformers model itself."""
    impl = config.model.impl
    if impl in ("native", "auto") and native.supports(hf_model.config):
        model = native.from_hf_model(hf_model, share=True)  # the caller moves ours to its device
        if config.rollout.exact_logprobs:  # the engine's kernels, in every forward of the trainer
            problem = exact_kernels_refusal(model)
            if problem:
                raise UserError(f"rollout.exact_logprobs=true: {problem}")
            model.use_exact_kernels()
        return model
    if config.rollout.exact_logprobs:
        raise UserError(
            f"rollout.exact_logprobs=true runs our model in the trainer and the engine; model type "
            f"{hf_model.config.model_type!r} has none here (or model.impl=hf)"
        )
    if impl == "native":
        raise UserError(
            f"model.impl=native: model type {hf_model.config.model_type!r} has no native implementation"
        )
    if impl == "auto":
        print(
            f"model type {hf_model.config.model_type!r} has no native implementation: training it "
            "with transformers (padded micro-batches)",
            flush=True,
        )
    return hf_model


def lora_policy(config: Config, policy):
    """The policy with LoRA adapters (model.lora_rank > 0 or model.lora_adapter_path), else as is."""
    m = config.model
    if not (m.lora_rank or m.lora_adapter_path):
        return policy
    if not isinstance(policy, native.NativeModule):
        if m.lora_merged_forward:
            raise UserError(
                "model.lora_merged_forward=true is built for our model's LoRA, not PEFT's (model.impl=native)"
            )
        return peft_policy(config, policy)
    rank, alpha, targets = m.lora_rank, m.lora_alpha, m.lora_target_modules
    if m.lora_adapter_path:
        adapter = read_adapter_config(m.lora_adapter_path)
        rank, alpha, targets = adapter["r"], adapter["lora_alpha"], adapter["target_modules"]
    apply_lora(policy, rank, alpha, targets, merged_forward=m.lora_merged_forward)
    if m.lora_adapter_path:
        load_adapter(policy, m.lora_adapter_path)
    return policy


def peft_policy(config: Config, hf_model):
    """LoRA on a transformers model (a family without our native code) through PEFT."""
    try:
        from peft import PeftModel, get_peft_model
    except ImportError as e:
        raise UserError(
            f"model.lora_rank on a transformers model (no native implementation) uses PEFT: pip install peft ({e})"
        ) from e
    m = config.model
    if config.rollout.backend == "vllm":
        raise UserError(
            "model.lora_rank on a transformers model: use rollout.backend=hf (it shares the adapters)"
        )
    try:
        if m.lora_adapter_path:
            read_adapter_config(m.lora_adapter_path)
            return PeftModel.from_pretrained(hf_model, m.lora_adapter_path, is_trainable=True)
        return get_peft_model(hf_model, peft_lora_config(m.lora_rank, m.lora_alpha, m.lora_target_modules))
    except ValueError as e:  # PEFT names a target module the model lacks
        raise UserError(f"model.lora_target_modules={list(m.lora_target_modules)}: {e}") from e


def value_model(config: Config, policy, device: torch.device):
    """The critic's model: critic.model_path, or a copy of the policy under a zero value head; ours
    (packed) whenever the policy is."""
    if not config.critic.model_path:
        return value_model_from_policy(policy)
    model = load_value_model(config.critic.model_path, device, config.model.cache_dir)
    if isinstance(policy, native.NativeModule) and native.supports(model.config):
        return native.score_model_from_hf(model)
    return model


def compile_native_models(models: list) -> None:
    if not any(isinstance(m, native.NativeModule) for m in models):
        raise UserError("model.compile=true applies to the native model; set model.impl=native or auto")
    for model in models:
        if isinstance(model, native.NativeModule):
            model.compile_layers()


def rollout_backend(
    config: Config,
    hf_model,
    policy,
    tokenizer,
    device: torch.device,
    run_dir: Path,
    *,
    share_weights: bool = True,
    tp_mesh=None,
    kv_pool_tokens: int | None = None,
):
    """The native engine over the actor's model (it shares the weights when device and dtype match,
    else keeps a copy that update_weights refreshes; always a copy without `share_weights`; on a GPU its
    KV pool `kv_pool_tokens` when the memory plan, made once before the workers started, sized it),
    transformers' generate on the transformers model (for a native actor, a copy synced by name
    after each update), or vLLM."""
    from hybridflow.engine import EngineConfig, build_engine
    from hybridflow.engine.drafter import SpeculativeConfig

    c, r = config, config.rollout
    backend = r.backend
    if backend == "auto":
        backend = "native" if isinstance(policy, native.NativeCausalLM) else "hf"
    eos = stop_token_ids(hf_model, tokenizer)
    context = c.data.max_prompt_tokens + c.data.max_response_tokens
    replay = c.actor.router_replay == "R3"
    if replay and (backend != "native" or not isinstance(policy, native.NativeCausalLM)):
        raise UserError(
            f"actor.router_replay=R3 needs the experts our engine records (rollout.backend=native, "
            f"model.impl=native); this run has rollout.backend={backend}, model.impl={c.model.impl}"
        )
    if replay and policy.config.moe is None:
        raise UserError(
            "actor.router_replay=R3 replays a mixture-of-experts policy's routing, and this policy is dense; "
            "set actor.router_replay=disabled"
        )
    if backend == "vllm":
        from hybridflow.rollout.vllm import VLLMBackend

        start = run_dir / "rollout_start_policy"  # the starting weights, as a directory vLLM loads
        save_hf(hf_model, tokenizer, start, overwrite=True)
        return VLLMBackend(
            str(start),
            eos_token_ids=eos,
            max_model_len=context,
            gpu_memory_utilization=r.gpu_memory_utilization,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            seed=c.trainer.seed,
        )
    if backend == "hf":
        return HFBackend(
            hf_model,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_ids=eos,
            max_batch_sequences=r.max_batch_sequences,
        )
    if not isinstance(policy, native.NativeCausalLM):
        raise UserError(
            f"rollout.backend=native runs our model, and model type {hf_model.config.model_type!r} "
            "has none (or model.impl=hf); use rollout.backend=hf"
        )
    kv_tokens = r.kv_cache_tokens
    if kv_tokens is None and device.type == "cuda":  # a pool kept beside training gets what the plan leaves
        kv_tokens = kv_pool_tokens
    compute = c.actor.compute_dtype
    if compute == "auto":
        compute = "bfloat16" if device.type == "cuda" else str(next(policy.parameters()).dtype)[6:]
    engine_config = EngineConfig(
        max_batch_sequences=r.max_batch_sequences,
        max_prefill_tokens=r.max_prefill_tokens,
        max_context_tokens=context,
        kv_cache_tokens=kv_tokens,
        gpu_memory_utilization=r.gpu_memory_utilization,
        cuda_graphs=r.cuda_graphs,
        decode_steps=r.decode_steps,
        compile_layers=c.model.compile,
        compute_dtype=compute,
        share_weights=share_weights,
        prefix_cache=r.prefix_cache,
        keep_kv_on_weight_update=r.keep_kv_on_weight_update,
        progress=c.trainer.progress,
        record_routes=replay,
        exact_logprobs=c.rollout.exact_logprobs,
        speculative=SpeculativeConfig(**dataclasses.asdict(r.speculative)),
    )
    if lora_modules(policy):  # the engine runs plain merged weights; syncs refresh the adapted layers
        policy = merged_model(policy)
    # tp_mesh: rollout.tensor_parallel_size (the actor's TP groups); every rank shards its own copy
    return build_engine(policy, eos_token_ids=eos, device=device, config=engine_config,
                        sequences=sequences_per_step(c), tp_mesh=tp_mesh)  # fmt: skip
