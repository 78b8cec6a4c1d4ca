"""Peak GPU memory per phase of an RL step, estimated from the config and the model's shape alone
(no weights loaded), with suggestions when a phase will not fit: `hybridflow plan`, and the
trainer's start-up line.

Per GPU, with W workers (FSDP2 shards the trained models W ways; the engine keeps a full copy):
  resident   actor master weights + gradients + Adam (dtype x 1, x 1, fp32 x 2 per parameter, / W),
             reference weights (/ W), critic the same as the actor, the engine's weights (bf16
             matmuls, fp32 embedding, a bf16 LM head); offloaded parts (actor.offload_params,
             actor.offload_optimizer, ref.offload_params) live in CPU memory instead, and an
             offloaded model gathers a layer (and prefetches the next) onto the GPU as it runs
  gen        resident + the KV pool (gpu_memory_utilization of the memory free when the engine is
             built — sharded or offloaded: once the models are — at most room for
             max_batch_sequences at full context; or rollout.kv_cache_tokens);
             disaggregated (resources.rollout_workers), on a rollout GPU: the engine + its pool, and
             W counts the training GPUs only
  ref / old_log_prob   resident + a forward's logits chunks and one layer's temporaries
  update_actor         resident + saved activations + the log-prob chunks' forward and backward + the
                       LM head's backward (a bf16 copy of its weight, its fp32 gradient, a [V, H] product)
  update_weights       resident + one gathered layer
  (colocated with rollout.free_cache_engine=false, or an asynchronous run whose engine generates
  while the trainer works or keeps the K/V of its sequences in flight across updates: the KV pool
  stays, so every phase holds it)
Activations: 11.8 bytes x (hidden + intermediate) per token per layer under bf16 autocast with an
fp32 master, and 2 x chunk x vocabulary x 2 bytes for the log-prob chunks — both fitted to the peaks
measured on one H200 (docs/benchmarks.md), which the estimate reproduces within a few percent."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.config.schema import Config
from hybridflow.controller.worker_models import WorkerLayout, sharded_policy_path, sharded_reference_path
from hybridflow.devices import DTYPES
from hybridflow.errors import UserError
from hybridflow.stream.admission import pauses_for_training

GIB = 2**30
ACTIVATION_BYTES = 11.8  # per token, per layer, per (hidden + intermediate) unit
LOGPROB_CHUNK = 2048  # tokens per log-prob chunk (models/native/logprobs.py)
CUDA_CONTEXT = GIB  # the CUDA context and allocator slack, per process
PLAN_SLACK = 0.05  # of the GPU, kept free when the pool is sized beside training (the estimate's error)
ENGINE_PAGE = 64  # tokens per KV page of the native engine on CUDA


@dataclass
class ModelShape:
    params: int
    vocab: int
    hidden: int
    intermediate: float  # per token and layer (MoE: the active experts'; active_intermediate)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    active_params: float = 0.0  # the parameters one token goes through (MoE: top_k of the experts)
    experts: int = 0  # experts per MoE layer (0: dense)

    def __post_init__(self) -> None:
        self.active_params = self.active_params or float(self.params)

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelShape:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        params = sum(p.numel() for p in model.parameters())  # a tied head counts once
        share = _active_expert_share(hf_config)
        active = sum(p.numel() * (share if ".experts." in n else 1.0) for n, p in model.named_parameters())
        heads = hf_config.num_attention_heads
        return cls(
            params=params,
            active_params=active,
            vocab=hf_config.vocab_size,
            hidden=hf_config.hidden_size,
            intermediate=active_intermediate(hf_config),
            layers=hf_config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
            experts=_num_experts(hf_config),
        )

    @property
    def embedding(self) -> int:
        return self.vocab * self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def _active_expert_share(hf_config) -> float:
    """top_k / num_experts of an MoE model's expert weights work on each token (1 for a dense model)."""
    k = getattr(hf_config, "num_experts_per_tok", None)
    experts = _num_experts(hf_config)
    return k / experts if k and experts else 1.0


def _num_experts(hf_config) -> int:
    return getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None) or 0


def active_intermediate(hf_config) -> float:
    """The feed-forward width whose activations a token keeps, averaged over the layers: a dense
    layer's intermediate size; an MoE layer's top_k experts each keep their intermediate channels and
    a copy of the token's hidden state (the dispatch gathers, the combine scatters). The MoE term is
    counted, not measured: the dense fit is the one the H200 peaks confirm."""
    from hybridflow.models.native.config import moe_config

    dense = getattr(hf_config, "intermediate_size", None) or 4 * hf_config.hidden_size
    moe = (
        moe_config(hf_config) if getattr(hf_config, "model_type", None) in ("mixtral", "qwen3_moe") else None
    )
    if moe is None:
        return dense
    sparse = moe.top_k * (moe.intermediate_size + hf_config.hidden_size)
    layers = hf_config.num_hidden_layers
    return (len(moe.sparse_layers) * sparse + (layers - len(moe.sparse_layers)) * dense) / layers


@dataclass
class MemoryPlan:
    gpu_bytes: int
    workers: int
    resident: dict[str, float]  # bytes of each always-resident part
    phases: dict[str, float]  # peak bytes per phase
    kv_tokens: int
    pool_capped: bool = False  # the pool stays beside training and was sized down so that training fits
    suggestions: list[str] = field(default_factory=list)

    def fits(self) -> bool:
        return max(self.phases.values()) <= self.gpu_bytes

    def summary(self) -> str:
        phases = ", ".join(f"{k} {v / GIB:.1f}" for k, v in self.phases.items())
        capped = " (what training leaves beside it)" if self.pool_capped else ""
        return (
            f"memory plan (GiB per GPU of {self.gpu_bytes / GIB:.0f}, {self.workers} worker(s)): {phases}; "
            f"KV pool {self.kv_tokens:,} tokens{capped}"
        )

    def report(self) -> str:
        lines = [self.summary(), "resident:"]
        lines += [f"  {k:<22} {v / GIB:8.2f} GiB" for k, v in self.resident.items()]
        lines += ["peak per phase:"]
        lines += [
            f"  {k:<22} {v / GIB:8.2f} GiB{'  > GPU memory' if v > self.gpu_bytes else ''}"
            for k, v in self.phases.items()
        ]
        lines += [f"suggestion: {s}" for s in self.suggestions] or ["every phase fits"]
        return "\n".join(lines)


def _activations(shape: ModelShape, tokens: int, checkpointing: bool, tp: int = 1) -> float:
    """Saved activations of a micro-batch; under tensor parallelism the heads' and MLP channels'
    share (counted as the intermediate term) is split over the tp ranks, the hidden-size part not."""
    per_layer = ACTIVATION_BYTES * (shape.hidden + shape.intermediate / tp) * tokens
    if checkpointing:  # saved: each layer's fp32 input; recomputed: one layer at a time
        return shape.layers * tokens * shape.hidden * 4 + per_layer
    return shape.layers * per_layer


def head_backward_bytes(shape: ModelShape, tp: int = 1, master: int = 4) -> float:
    """The LM head's backward (models/native/logprobs.py) beside the saved activations: a bf16 copy
    of the weight [V, H] (none when the weights are bf16 already: `master` bytes a parameter), its
    float32 gradient accumulator and one bf16 [V, H] product of a chunk."""
    return ((2 if master != 2 else 0) + 4 + 2) * shape.vocab * shape.hidden / tp


def engine_bytes(shape: ModelShape) -> float:
    """The engine's whole copy: bf16 matmuls, an fp32 embedding, a bf16 LM head (a tied head gets a
    copy of its own; an untied one is a matmul)."""
    matmul = shape.params - shape.embedding * (1 if shape.tied else 2)
    return 2 * matmul + 4 * shape.embedding + 2 * shape.embedding


def load_bytes(c: Config, shape: ModelShape, layout: WorkerLayout, workers: int) -> float:
    """What a training worker holds at once before FSDP2 shards anything (build_models): whole copies
    of the policy (converted on the CPU, then moved; transformers' model as loaded beside it only for
    rollout.backend=hf), the reference (none with LoRA: the base is the actor's), the critic and the
    engine (split over its TP group right after it is made). A policy or reference read shard by shard
    from safetensors (parallel/sharded_load.py) counts its shard alone."""
    master = DTYPES[c.model.dtype].itemsize
    p = shape.params
    read_sharded = sharded_policy_path(c, layout, workers) is not None
    if read_sharded:  # the policy read shard by shard (and a critic made from it)
        held = 0 if c.actor.offload_params else master * p / workers
    else:
        held = master * p * (2 if c.rollout.backend == "hf" and c.model.impl != "hf" else 1)
    if sharded_reference_path(c, layout) is not None:
        held += 0 if c.ref.offload_params else master * p / workers
    elif layout.needs_ref and not (c.model.lora_rank or c.model.lora_adapter_path):
        held += master * p
    if layout.needs_critic:
        held += master * (p - (0 if shape.tied else shape.embedding)) / (workers if read_sharded else 1)
    if layout.colocated:
        held += engine_bytes(shape)
    return held


def estimate(config: Config, shape: ModelShape, *, gpu_bytes: int, workers: int) -> MemoryPlan:
    c = config
    master = DTYPES[c.model.dtype].itemsize  # the trained models' dtype
    w = workers
    p = shape.params
    resident: dict[str, float] = {}
    if not c.actor.offload_params:  # offloaded: weights, gradients and Adam live in CPU memory
        resident["actor weights"] = master * p / w
        resident["actor gradients"] = master * p / w
        if not c.actor.offload_optimizer:  # offloaded: on the GPU during the update only
            resident["actor Adam state"] = 8 * p / w
    layout = WorkerLayout.of(c, w)  # what each training worker holds, as the workers decide it
    needs_ref = layout.needs_ref
    if needs_ref and not c.ref.offload_params:
        resident["reference weights"] = master * p / w
    critic_params = p - (0 if shape.tied else shape.embedding)  # the backbone, no LM head
    if layout.needs_critic:
        resident["critic weights+grads+Adam"] = (2 * master + 8) * critic_params / w
    rtp = c.rollout.tensor_parallel_size  # an engine split over the actor's TP group: 1/rtp of it here
    engine = engine_bytes(shape) / rtp
    apart = not layout.colocated  # disaggregated: the engines sit on GPUs of their own
    if not apart:
        resident["engine weights"] = engine
    static = sum(resident.values()) + CUDA_CONTEXT
    # the engine is built before FSDP shards anything: full copies of the trained models are there
    at_engine_build = master * p * (1 + needs_ref) + engine
    if layout.needs_critic:
        at_engine_build += master * critic_params
    offloaded = c.actor.offload_params or (needs_ref and c.ref.offload_params)
    if layout.sharded:  # the pool is sized again once the models are sharded (no grads or Adam yet)
        at_engine_build = (
            resident.get("actor weights", 0.0)
            + resident.get("reference weights", 0.0)
            + (master * critic_params / w if layout.needs_critic else 0.0)
            + engine
        )
    if apart:  # a rollout worker sizes its pool beside the engine alone
        at_engine_build = engine
    kv_per_token = shape.kv_bytes_per_token() / rtp  # the local KV heads' pages
    if c.rollout.kv_cache_tokens is not None:
        kv_bytes = c.rollout.kv_cache_tokens * kv_per_token
    else:
        kv_bytes = max(c.rollout.gpu_memory_utilization * (gpu_bytes - CUDA_CONTEXT - at_engine_build), 0.0)
        # the engine's cap: room for max_batch_sequences at full context, in whole pages of 64
        pages = -(-(c.data.max_prompt_tokens + c.data.max_response_tokens) // ENGINE_PAGE)
        kv_bytes = min(kv_bytes, c.rollout.max_batch_sequences * pages * ENGINE_PAGE * kv_per_token)
    tp = c.actor.tensor_parallel_size  # each rank holds vocab / tp of the logits, intermediate / tp channels
    logits = 2 * LOGPROB_CHUNK * shape.vocab / tp * 2  # two bf16 [chunk, V] blocks (Triton softmax kernels)
    forward = logits + 4 * (shape.hidden + shape.intermediate / tp) * c.ref.max_tokens_per_microbatch
    layer = master * (p - shape.embedding) / shape.layers
    # an offloaded model gathers each layer (and prefetches the next) onto the GPU as it runs
    gathered = 2 * layer + master * shape.embedding * (1 if shape.tied else 2)
    optimizer_for_update = 8 * p / w if c.actor.offload_optimizer and not c.actor.offload_params else 0.0
    phases = {
        "ref/old_log_prob": static + forward + (gathered if offloaded else 0.0),
        # an offloaded optimizer comes back for the step, after the activations are freed
        "update_actor": static
        + max(
            _activations(shape, c.actor.max_tokens_per_microbatch, c.model.enable_gradient_checkpointing, tp)
            + logits
            + head_backward_bytes(shape, tp, master)
            + (gathered + layer if c.actor.offload_params else 0.0),  # + a layer's gradients on their way out
            optimizer_for_update,
        ),
    }
    if layout.needs_critic:
        phases["update_critic"] = static + _activations(
            shape, c.critic.max_tokens_per_microbatch, c.model.enable_gradient_checkpointing, tp
        )
    phases["update_weights"] = static + (layer if w > 1 or c.actor.offload_params else 0.0)
    capped = False
    beside = pool_beside_training(c, layout)  # the engine works while the trainer does, or keeps its cache
    if beside and c.rollout.kv_cache_tokens is None:
        # the pool gets what the other phases leave; the engine is built with that size
        # (pool_tokens_beside_training)
        room = max(gpu_bytes * (1 - PLAN_SLACK) - max(phases.values()), 0.0)
        capped = room < kv_bytes
        kv_bytes = min(kv_bytes, room)
    if beside:  # every phase holds the pool
        phases = {k: v + kv_bytes for k, v in phases.items()}
    phases = {"gen": (CUDA_CONTEXT + engine if apart else static) + kv_bytes, **phases}
    phases["load"] = CUDA_CONTEXT + load_bytes(c, shape, layout, w)
    plan = MemoryPlan(gpu_bytes, w, resident, phases, int(kv_bytes // kv_per_token), pool_capped=capped)
    held = kv_bytes if beside else 0.0  # through the update too
    plan.suggestions = _suggestions(config, shape, plan, static + held, logits, kv_per_token)
    return plan


def _suggestions(
    config: Config, shape: ModelShape, plan: MemoryPlan, static, logits, kv_per_token
) -> list[str]:
    c, out = config, []
    room = plan.gpu_bytes - static - logits
    need = min(c.rollout.max_batch_sequences, c.data.prompts_per_step * c.rollout.samples_per_prompt) * (
        c.data.max_prompt_tokens + c.data.max_response_tokens
    )
    if plan.phases["update_actor"] > plan.gpu_bytes:
        per_token = _activations(
            shape, 1, c.model.enable_gradient_checkpointing, c.actor.tensor_parallel_size
        )
        fits = int(room // per_token) if room > 0 else 0
        if fits >= 512:
            out.append(
                f"actor.max_tokens_per_microbatch={fits // 512 * 512} (now {c.actor.max_tokens_per_microbatch})"
            )
        if not c.model.enable_gradient_checkpointing:
            out.append("model.enable_gradient_checkpointing=true (saves each layer's input only)")
        if fits < 4096:
            out.append("more GPUs (FSDP2 shards weights, gradients and Adam state over them)")
            if not c.actor.offload_params:
                out.append(
                    "actor.offload_params=true (weights, gradients and Adam in CPU memory; the step runs "
                    "on the CPU)"
                )
    short_of_kv = plan.phases["gen"] > plan.gpu_bytes or plan.kv_tokens < need
    if short_of_kv and not (c.actor.offload_optimizer or c.actor.offload_params):
        out.append("actor.offload_optimizer=true (Adam's state in CPU memory outside the update)")
    if plan.kv_tokens < need:
        more = (
            "lower actor.max_tokens_per_microbatch or turn on model.enable_gradient_checkpointing (the pool "
            "gets what training leaves)"
            if plan.pool_capped
            else "raise rollout.gpu_memory_utilization"
        )
        out.append(
            f"the KV pool holds {plan.kv_tokens:,} tokens, less than {need:,} for a full batch at full length: "
            f"{more} or lower rollout.max_batch_sequences (sequences are preempted and recomputed otherwise)"
        )
    if plan.phases["gen"] > plan.gpu_bytes and c.rollout.kv_cache_tokens is not None:
        fits = int((plan.gpu_bytes - static) // kv_per_token)
        out.append(f"rollout.kv_cache_tokens={max(fits, 0):,} (now {c.rollout.kv_cache_tokens:,})")
    return out


def model_shape(config: Config) -> ModelShape:
    """The shape of `config`'s model, from its config file alone."""
    return ModelShape.from_hf_config(model_hf_config(config))


def model_hf_config(config: Config):
    """`config`'s model's transformers config (its config file alone)."""
    from hybridflow.models.loading import load_model_config

    return load_model_config(config.model)


def pool_beside_training(config: Config, layout: WorkerLayout) -> bool:
    """The colocated engine keeps its KV pool while the other roles run: it generates meanwhile (an
    asynchronous run whose engine does not pause for training), keeps the K/V of its sequences in
    flight across the update (rollout.keep_kv_on_weight_update) or keeps its cache
    (rollout.free_cache_engine=false)."""
    c = config
    generates_meanwhile = c.trainer.async_mode != "off" and not pauses_for_training(c)
    keeps = c.rollout.keep_kv_on_weight_update or not c.rollout.free_cache_engine
    return layout.colocated and (generates_meanwhile or keeps)


def pool_tokens_beside_training(config: Config, plan: MemoryPlan) -> int | None:
    """The KV pool's size in tokens for a colocated engine on CUDA that keeps it beside training, with
    no rollout.kv_cache_tokens given: what the memory `plan` leaves once the other phases fit; None
    where the pool is not sized down. Stops with one line when not even one sequence fits."""
    c = config
    if c.rollout.kv_cache_tokens is not None:
        return None
    if not plan.pool_capped:
        return None
    context = c.data.max_prompt_tokens + c.data.max_response_tokens
    if plan.kv_tokens < context:
        why = "rollout.free_cache_engine=false"
        if c.rollout.keep_kv_on_weight_update:
            why = "rollout.keep_kv_on_weight_update=true"
        elif c.trainer.async_mode != "off":
            why = "an asynchronous run"
        raise UserError(
            f"the KV pool stays beside training ({why}) and the memory plan leaves it {plan.kv_tokens:,} "
            f"tokens, less than one sequence of {context:,}: "
            + ("; ".join(plan.suggestions) or "train with less memory")
            + " (`hybridflow plan` shows each phase)"
        )
    return plan.kv_tokens


def plan_inputs(
    config: Config, *, gpu_bytes: int | None = None, workers: int | None = None
) -> tuple[ModelShape, int, int]:
    """`config`'s model shape (its config file only), this machine's GPU memory (or `gpu_bytes`; 80
    GiB without a GPU) and the training workers (or `workers`)."""
    shape = model_shape(config)
    if gpu_bytes is None:
        gpu_bytes = (
            torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 80 * GIB
        )
    if workers is None:
        workers = (
            config.resources.n_gpus_per_node * config.resources.nnodes - config.resources.rollout_workers
        )
    return shape, gpu_bytes, workers


def plan_for(config: Config, *, gpu_bytes: int | None = None, workers: int | None = None) -> MemoryPlan:
    """The plan for `config`'s model (its config file only) on this machine's GPU, or `gpu_bytes`."""
    shape, gpu_bytes, workers = plan_inputs(config, gpu_bytes=gpu_bytes, workers=workers)
    return estimate(config, shape, gpu_bytes=gpu_bytes, workers=workers)
