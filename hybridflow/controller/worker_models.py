"""What one training worker holds, built one way: the layout decided from the config and the group's
size (reference or not, sharded or not, the engine here or on rollout workers), then the models in the
order that matters (the engine copies the policy and the reference is copied from it before anything
is sharded), then FSDP2 and sequence parallelism. HybridWorker wraps the result in its roles."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridflow.algorithms.estimators import estimator
from hybridflow.config.schema import Config
from hybridflow.controller.role_models import lora_policy, policy_model, rollout_backend, value_model
from hybridflow.devices import DTYPES, seed_process
from hybridflow.errors import UserError
from hybridflow.models import native
from hybridflow.models.loading import load_model, load_model_config, load_model_tokenizer
from hybridflow.models.lora import has_adapters, lora_reference
from hybridflow.parallel.sharded_load import load_sharded, safetensors_dir, shardable_config
from hybridflow.parallel.ulysses import apply_sequence_parallel, init_sequence_parallel


@dataclass(frozen=True)
class WorkerLayout:
    needs_ref: bool
    """A KL term (actor.use_kl_loss or algorithm.use_kl_in_reward) needs the reference policy."""
    needs_critic: bool
    """The advantage estimator needs a critic's values."""
    shard_actor: bool
    """FSDP2 over the workers; in one worker, what offloads its parameters to the CPU."""
    shard_ref: bool
    colocated: bool
    """The rollout engine on this worker (the hybrid engine); else on rollout workers of their own."""

    @property
    def sharded(self) -> bool:
        return self.shard_actor or self.shard_ref

    @classmethod
    def of(cls, c: Config, world_size: int) -> WorkerLayout:
        needs_ref = c.actor.use_kl_loss or c.algorithm.use_kl_in_reward
        # with LoRA the reference is the policy's base with the adapters off (sharded with it): no
        # copy of its own to offload (ref.offload_params, in verl's LoRA scripts, has nothing to act on)
        base_is_ref = lora_reference(c)
        return cls(
            needs_ref=needs_ref,
            needs_critic=estimator(c.algorithm.adv_estimator).needs_critic,
            shard_actor=world_size > 1 or c.actor.offload_params,
            shard_ref=needs_ref and not base_is_ref and (world_size > 1 or c.ref.offload_params),
            colocated=c.resources.rollout_workers == 0,
        )

    def check(self, c: Config, model: torch.nn.Module, model_type: str) -> None:
        """What a sharded layout cannot run yet, refused before anything is built on it."""
        if not self.sharded:
            return
        if not isinstance(model, native.NativeModule):
            raise UserError(
                f"FSDP2 (more than one worker, or actor/ref.offload_params) needs our native model; model "
                f"type {model_type!r} has none (or model.impl=hf)"
            )
        if c.model.compile:
            raise UserError(
                "model.compile=true runs unsharded only for now (one worker, no offload_params); set "
                "model.compile=false"
            )
        if c.rollout.backend == "vllm":
            raise UserError(
                "rollout.backend=vllm runs unsharded only (one worker, no offload_params); use "
                "rollout.backend=native"
            )


@dataclass
class WorkerModels:
    layout: WorkerLayout
    tokenizer: Any
    hf_config: Any
    hf_model: torch.nn.Module
    model: torch.nn.Module
    """The policy (with LoRA adapters where asked), sharded per the layout."""
    ref_model: torch.nn.Module | None
    """The reference; `model` itself with LoRA (adapters off is the base)."""
    critic_model: torch.nn.Module | None
    backend: Any
    """The rollout backend (colocated), holding its own full copy; None on a disaggregated worker."""
    lora: bool
    own_process_group: bool
    """An in-process worker started a one-rank process group for FSDP2 (it ends it at shutdown)."""
    engine_empty: bool = False
    """The engine was built to the policy's shape only (the policy read shard by shard): the worker
    fills it with a weight sync before anything generates."""


def build_models(c: Config, world_size: int, device: torch.device, *, kv_pool_tokens: int | None = None
                 ) -> WorkerModels:  # fmt: skip
    """`kv_pool_tokens`: the engine's KV pool as the memory plan sized it (plan/layout.py plan_run)."""
    seed_process(c.trainer.seed, deterministic=c.deterministic_processes)
    policy_path = sharded_policy_path(c, WorkerLayout.of(c, world_size), world_size)
    if policy_path is not None:
        return _build_read_sharded(c, world_size, device, policy_path, kv_pool_tokens)
    hf_model, tokenizer = load_model(c.model)
    # converted where it was loaded (the CPU), sharing its tensors, then moved: one copy on the GPU
    model = policy_model(c, hf_model).to(device)
    if c.rollout.backend == "hf":  # transformers' generate runs the loaded model itself
        hf_model.to(device)
    layout = WorkerLayout.of(c, world_size)
    layout.check(c, model, hf_model.config.model_type)
    _check_tensor_parallel(c, world_size, model, layout)
    critic_model = value_model(c, model, device) if layout.needs_critic else None
    model = lora_policy(c, model)
    lora = has_adapters(model)  # (what LoRA does not combine with yet: the start's checks)
    ref_model, ref_path = None, sharded_reference_path(c, layout)  # with a path: read in _shard
    if ref_path is None and layout.needs_ref and c.ref.model_path:
        ref_hf, _ = load_model(c.model, c.ref.model_path)
        ref_model = policy_model(c, ref_hf).to(device)
    elif ref_path is None and layout.needs_ref:  # with LoRA the reference is the actor's own base: no copy
        ref_model = model if lora else copy.deepcopy(model)
    grid = _tensor_parallel_grid(c, world_size, device)
    # the rollout backend takes its own full copy before the trained models are sharded, or when it
    # generates while the trainer updates (an asynchronous run); split over the actor's TP groups
    # with rollout.tensor_parallel_size, or over groups of its own where the actor has none
    backend = (
        rollout_backend(c, hf_model, model, tokenizer, device, Path(c.trainer.run_dir),
                        share_weights=not layout.shard_actor and c.trainer.async_mode == "off",
                        tp_mesh=engine_mesh(c, world_size, device, grid), kv_pool_tokens=kv_pool_tokens)
        if layout.colocated
        else None
    )  # fmt: skip
    own_group, ref_model, model, critic_model = _shard(
        c, layout, world_size, device, model, ref_model, critic_model, grid, ref_path
    )
    sp = init_sequence_parallel(c.actor.sequence_parallel_size)
    if sp is not None:  # every trained (and reference) model splits its micro-batches' tokens
        for m in (model, ref_model, critic_model):
            if m is not None:
                apply_sequence_parallel(m, sp)
    return WorkerModels(layout, tokenizer, hf_model.config, hf_model, model, ref_model, critic_model, backend,
                        lora, own_group)  # fmt: skip


def _tensor_parallel_grid(c: Config, world_size: int, device: torch.device):
    """The (dp, tp) device mesh of actor.tensor_parallel_size (consecutive ranks split each layer;
    FSDP2 shards over the groups), or None without tensor parallelism."""
    tp = c.actor.tensor_parallel_size
    if tp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def engine_mesh(c: Config, world_size: int, device: torch.device, grid=None):
    """The 1-D 'tp' mesh an engine splits over (rollout.tensor_parallel_size): the actor's TP group
    where it has that size, else consecutive ranks of their own (rollout workers, `grid` None, always);
    None for whole engines. A sync reshards into it point to point (parallel/reshard.py)."""
    rtp = c.rollout.tensor_parallel_size
    if rtp == 1:
        return None
    if grid is not None and c.actor.tensor_parallel_size == rtp:
        return grid["tp"]
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size // rtp, rtp), mesh_dim_names=("rollout_dp", "tp"))["tp"]


def _build_read_sharded(c: Config, world_size: int, device: torch.device, path: Path,
                        kv_pool_tokens: int | None) -> WorkerModels:  # fmt: skip
    """A training worker whose policy (and reference, and critic) are read shard by shard, never
    whole: the engine (colocated) is built to the policy's shape and filled by a first weight sync,
    one FSDP unit at a time; disaggregated, the rollout workers load their own."""
    from transformers import GenerationConfig

    hf_config = load_model_config(c.model, path)
    tokenizer = load_model_tokenizer(c.model, str(path))
    layout = WorkerLayout.of(c, world_size)
    config = shardable_config(path)
    with torch.device("meta"):  # what the checks look at: no weights
        probe = native.NativeCausalLM(config)
    layout.check(c, probe, hf_config.model_type)
    _check_tensor_parallel(c, world_size, probe, layout)
    ref_model, ref_path = None, sharded_reference_path(c, layout)
    if ref_path is None and layout.needs_ref:  # ref.model_path elsewhere, in a form read whole
        ref_hf, _ = load_model(c.model, c.ref.model_path)
        ref_model = policy_model(c, ref_hf).to(device)
    grid = _tensor_parallel_grid(c, world_size, device)
    backend = None
    if layout.colocated:
        with torch.device("meta"):  # the engine's shape; where generation stops
            template = native.NativeCausalLM(config).to(DTYPES[c.model.dtype])
        template.generation_config = GenerationConfig.from_model_config(hf_config)
        if (path / "generation_config.json").is_file():
            template.generation_config = GenerationConfig.from_pretrained(path)
        engine_tp = engine_mesh(c, world_size, device, grid)
        backend = rollout_backend(c, template, template, tokenizer, device, Path(c.trainer.run_dir),
                                  share_weights=False, tp_mesh=engine_tp, kv_pool_tokens=kv_pool_tokens)  # fmt: skip
    own_group, ref_model, model, critic_model = _shard(
        c, layout, world_size, device, None, ref_model, None, grid, ref_path, policy_path=path
    )
    sp = init_sequence_parallel(c.actor.sequence_parallel_size)
    if sp is not None:
        for m in (model, ref_model, critic_model):
            if m is not None:
                apply_sequence_parallel(m, sp)
    return WorkerModels(layout, tokenizer, hf_config, None, model, ref_model, critic_model, backend, False,
                        own_group, engine_empty=backend is not None)  # fmt: skip


def sharded_policy_path(c: Config, layout: WorkerLayout, world_size: int) -> Path | None:
    """Where an FSDP2-sharded policy is read shard by shard (and a critic made from it: over more
    than one worker, as it is sharded then): the native engine or none here (rollout workers load
    theirs), a native checkpoint in safetensors (dense or MoE), no LoRA; else None (loaded whole, then
    sharded)."""
    m = c.model
    if not layout.shard_actor:
        return None
    if layout.needs_critic and (c.critic.model_path or world_size == 1):
        return None
    if layout.colocated and c.rollout.backend not in ("auto", "native"):  # hf / vLLM start from a whole model
        return None
    if m.lora_rank or m.lora_adapter_path or m.impl == "hf":
        return None
    path = safetensors_dir(m.path)
    return path if path is not None and shardable_config(path) is not None else None


def sharded_reference_path(c: Config, layout: WorkerLayout) -> Path | None:
    """Where an FSDP2-sharded reference is read from shard by shard (a native checkpoint in
    safetensors; not with LoRA, whose reference is the actor's base), or None: it is then a whole copy
    of the policy (or of ref.model_path) until it is sharded."""
    m = c.model
    if not (layout.needs_ref and layout.shard_ref) or m.lora_rank or m.lora_adapter_path or m.impl == "hf":
        return None
    path = safetensors_dir(c.ref.model_path or m.path)
    return path if path is not None and shardable_config(path) is not None else None


def _shard(c: Config, layout: WorkerLayout, world_size: int, device: torch.device, model, ref_model,
           critic_model, grid, ref_path: Path | None, *, policy_path: Path | None = None):  # fmt: skip
    """FSDP2 per the layout (the reference read shard by shard from `ref_path`, the policy from
    `policy_path` and, where one is needed, the critic from it too: the policy's backbone under a zero
    value head, as value_model makes it); whether a one-rank process group was started for it here,
    the reference, the policy and the critic."""
    if not layout.sharded:
        return False, ref_model, model, critic_model
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.parallel import apply_fsdp

    own_group = False
    if not torch.distributed.is_initialized():  # one in-process worker
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=torch.distributed.HashStore(),
            rank=0,
            world_size=1,
            device_id=_indexed(device),
        )
        own_group = True
    tp = c.actor.tensor_parallel_size
    if grid is not None:
        from hybridflow.parallel import collectives
        from hybridflow.parallel.tensor import apply_tensor_parallel

        for m in (model, ref_model, critic_model):  # (a reference read shard by shard is split as it is made)
            if m is not None:
                apply_tensor_parallel(m, grid["tp"])
        collectives.set_sequence_parallel_size(tp)  # a group's ranks hold the same data
        mesh = grid["dp"]
    else:
        mesh = init_device_mesh(device.type, (world_size,))
    if (
        c.actor.expert_parallel_size > 1
    ):  # the whole data-parallel group, before FSDP2 (which then skips them)
        from hybridflow.parallel.expert import apply_expert_parallel

        for m in (model, ref_model, critic_model):  # those of them with experts (a reference or critic
            if isinstance(m, native.NativeModule) and m.config.moe is not None:  # of their own may have none)
                apply_expert_parallel(m, mesh, c.actor.expert_parallel_size)
    dtype, tp_mesh = DTYPES[c.model.dtype], grid["tp"] if grid is not None else None
    split = {
        "mesh": mesh,
        "device": device,
        "tp_mesh": tp_mesh,
        "expert_parallel_size": c.actor.expert_parallel_size,
    }
    if policy_path is not None:
        config = shardable_config(policy_path)
        model = load_sharded(policy_path, config, dtype, offload_params=c.actor.offload_params, **split)
        if layout.needs_critic:
            critic_model = load_sharded(policy_path, config, dtype, value_head=True, **split)
    elif layout.shard_actor:
        apply_fsdp(model, mesh, offload_params=c.actor.offload_params)
    if ref_path is not None:
        ref_model = load_sharded(ref_path, shardable_config(ref_path), dtype, offload_params=c.ref.offload_params,
                                 **split)  # fmt: skip
    elif layout.shard_ref:
        apply_fsdp(ref_model, mesh, offload_params=c.ref.offload_params)
    if critic_model is not None and world_size > 1 and policy_path is None:
        apply_fsdp(critic_model, mesh)
    return own_group, ref_model, model, critic_model


def check_parallel_sizes(c: Config, world_size: int, hf_config) -> None:
    """What the training workers would refuse about the parallel sizes of `c` for a model of
    `hf_config`, without building anything (`hybridflow plan` says it before planning memory)."""
    probe = None
    if c.model.impl != "hf" and native.supports(hf_config):
        from hybridflow.models.native.config import from_hf

        with torch.device("meta"):
            probe = native.NativeCausalLM(from_hf(hf_config))
    _check_tensor_parallel(c, world_size, probe, WorkerLayout.of(c, world_size))


def _check_tensor_parallel(c: Config, world_size: int, model, layout: WorkerLayout) -> None:
    """What actor/rollout.tensor_parallel_size and actor.expert_parallel_size cannot run with yet, one
    line each, before anything is built."""
    _check_rollout_tensor_parallel(c, world_size, model)
    _check_expert_parallel(c, world_size, model)
    tp = c.actor.tensor_parallel_size
    if tp == 1:
        return
    refusals = [
        (
            world_size % tp != 0 or not layout.sharded,
            f"needs a multiple of {tp} training workers (resources.num_workers / trainer.n_gpus_per_node), "
            f"not {world_size}",
        ),
        (
            not isinstance(model, native.NativeCausalLM),
            "runs our native models (not model.impl=hf)",
        ),
    ]  # (and what it does not combine with yet: controller/compatibility.py, at the start)
    _refuse_first(f"actor.tensor_parallel_size={tp}", refusals)


def _check_expert_parallel(c: Config, world_size: int, model) -> None:
    ep = c.actor.expert_parallel_size
    if ep == 1:
        return
    moe = getattr(getattr(model, "config", None), "moe", None)
    refusals = [
        (
            not isinstance(model, native.NativeModule) or moe is None,
            "splits the experts of our native mixture-of-experts models (Qwen3-MoE, Mixtral); this policy has none",
        ),
        (
            world_size % ep != 0,
            f"needs a multiple of {ep} training workers (resources.num_workers / trainer.n_gpus_per_node), "
            f"not {world_size}",
        ),
        (
            moe is not None and moe.num_experts % ep != 0,
            f"does not divide num_experts={moe and moe.num_experts}",
        ),
    ]  # (and what it does not combine with yet: controller/compatibility.py, at the start)
    _refuse_first(f"actor.expert_parallel_size={ep}", refusals)


def _check_rollout_tensor_parallel(c: Config, world_size: int, model) -> None:
    rtp = c.rollout.tensor_parallel_size
    if rtp == 1:
        return
    apart = c.resources.rollout_workers  # the engines on rollout workers of their own
    workers = "rollout workers (resources.rollout_workers)" if apart else (
        "training workers (resources.num_workers / trainer.n_gpus_per_node)"
    )  # fmt: skip
    refusals = [
        ((apart or world_size) % rtp != 0, f"needs a multiple of {rtp} {workers}, not {apart or world_size}"),
        (
            not isinstance(model, native.NativeCausalLM),
            "splits our native models (not model.impl=hf)",
        ),
        (c.trainer.async_mode != "off", "runs synchronous generation only for now (trainer.async_mode=off)"),
        (c.rollout.backend not in ("auto", "native"), "splits the native engine (rollout.backend=native)"),
        (c.rollout.server, "does not serve the policy (rollout.server) yet"),
        (
            bool(c.rollout.agent.loop),
            "runs single-turn generation only for now: each rank would run the agent's tools itself",
        ),
    ]
    _refuse_first(f"rollout.tensor_parallel_size={rtp}", refusals)


def _refuse_first(setting: str, refusals: list[tuple[bool, str]]) -> None:
    """The first (refused, why) that holds, as one line naming the setting."""
    for refused, why in refusals:
        if refused:
            raise UserError(f"{setting} {why}")


def _indexed(device: torch.device) -> torch.device | None:
    """A CUDA device with its index, as a process group's device_id needs it (None off CUDA)."""
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
