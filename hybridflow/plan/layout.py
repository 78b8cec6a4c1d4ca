"""`hybridflow plan`'s choice of a training layout that fits the GPUs: the configured one when every
phase fits, else the first of a ladder of candidates, cheapest first, with what was tried before it;
or one line saying why the model cannot fit these GPUs at all.

The ladder (each rung keeps what the rungs before it turned on):
  as configured, then gradient checkpointing (one more forward per micro-batch, about a third more
  update compute), then tensor parallelism 2, 4, 8 (all-reduces in every layer; dense native models,
  a size dividing the training workers, heads, KV heads and MLP channels; it splits activations and
  logits, while FSDP2 already shards weights, gradients and Adam over every worker), then, without
  tensor parallelism (offloaded weights do not combine with it), the reference's weights in CPU
  memory (ref.offload_params: one forward a step), Adam's state (actor.offload_optimizer: a PCIe
  round trip a step), the actor's weights and gradients too (actor.offload_params: the step runs on
  the CPU). On each rung the micro-batch keeps its configured size if it fits, else the largest
  multiple of 1,024 tokens that does, down to one whole sequence (packed micro-batches lose little
  speed until they are small).
A phase fits when its estimate stays within (1 - PLAN_SLACK) of the GPU: the estimate's error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridflow.config.schema import Config
from hybridflow.controller.worker_models import WorkerLayout
from hybridflow.errors import UserError
from hybridflow.plan.memory import (
    CUDA_CONTEXT,
    GIB,
    PLAN_SLACK,
    MemoryPlan,
    ModelShape,
    engine_bytes,
    estimate,
    plan_inputs,
    pool_tokens_beside_training,
)

MICRO_STEP = 1024


@dataclass
class LayoutChoice:
    settings: dict[str, object]  # our keys to add to the config ({} : as configured)
    plan: MemoryPlan | None  # None: nothing on the ladder fits
    tried: list[str]  # each rung below the choice, and its largest phase
    why_not: str = ""  # when nothing fits: why, and what would

    def report(self) -> str:
        if self.plan is None:
            return "\n".join(["choice: nothing fits these GPUs: " + self.why_not, *self.tried_lines()])
        worst = max(self.plan.phases, key=self.plan.phases.get)
        peak = f"largest phase {worst} {self.plan.phases[worst] / GIB:.1f} GiB of {self.plan.gpu_bytes / GIB:.0f}"
        if not self.settings:
            return f"choice: as configured ({peak})"
        given = " ".join(
            f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings.items()
        )
        return "\n".join([f"choice: {given} ({peak})", *self.tried_lines()])

    def tried_lines(self) -> list[str]:
        return [f"  tried first: {t}" for t in self.tried]


def choose_layout(
    config: Config, shape: ModelShape, *, gpu_bytes: int, workers: int, hf_config=None
) -> LayoutChoice:
    """The cheapest rung of the ladder that fits; a rung training would refuse (its config checks,
    and with `hf_config` the workers' layout checks) is passed over and said so."""
    limit = gpu_bytes * (1 - PLAN_SLACK)
    tried: list[str] = []
    last: MemoryPlan | None = None
    for label, settings in _ladder(config, shape, workers):
        candidate = _with(config, settings)
        if settings and (refusal := _refused(candidate, workers, hf_config)):
            tried.append(f"{label}: refused ({refusal})")
            continue
        plan = estimate(candidate, shape, gpu_bytes=gpu_bytes, workers=workers)
        if not _fits(plan, limit):
            micro = _largest_micro_batch(candidate, shape, gpu_bytes, workers, limit)
            if micro is not None:
                settings = {**settings, "actor.max_tokens_per_microbatch": micro}
                plan = estimate(_with(config, settings), shape, gpu_bytes=gpu_bytes, workers=workers)
        if _fits(plan, limit):
            return LayoutChoice(settings, plan, tried)
        worst = max(plan.phases, key=plan.phases.get)
        tried.append(f"{label}: {worst} {plan.phases[worst] / GIB:.1f} GiB")
        last = plan
    return LayoutChoice({}, None, tried, _why_not(config, shape, last, limit))


def _ladder(c: Config, shape: ModelShape, workers: int):
    on: dict[str, object] = {}
    yield "as configured", dict(on)
    if not c.model.enable_gradient_checkpointing:
        on["model.enable_gradient_checkpointing"] = True
        yield "gradient checkpointing", dict(on)
    split_engine = engine_splits(c)
    if split_engine and c.actor.tensor_parallel_size == 1:  # training untouched: the engine alone
        for tp in tensor_parallel_sizes(c, shape, workers, above=c.rollout.tensor_parallel_size):
            yield f"the engine split over {tp}", {**on, "rollout.tensor_parallel_size": tp}
    for tp in tensor_parallel_sizes(c, shape, workers):
        engine = {"rollout.tensor_parallel_size": tp} if split_engine else {}
        yield (
            f"tensor parallel {tp}{' (the engine too)' if split_engine else ''}",
            {**on, "actor.tensor_parallel_size": tp, **engine},
        )
    if c.actor.tensor_parallel_size > 1:  # offloaded weights do not combine with it
        on["actor.tensor_parallel_size"] = 1
        if c.rollout.tensor_parallel_size > 1:
            on["rollout.tensor_parallel_size"] = 1
    if WorkerLayout.of(c, workers).needs_ref and not c.ref.offload_params:
        on["ref.offload_params"] = True
        yield "the reference in CPU memory", dict(on)
    if not c.actor.offload_optimizer and not c.actor.offload_params:
        on["actor.offload_optimizer"] = True
        yield "Adam in CPU memory", dict(on)
    if not c.actor.offload_params:
        on["actor.offload_params"] = True
        yield "the actor in CPU memory", dict(on)


def engine_splits(c: Config) -> bool:
    """The engine can be split with the actor (worker_models' refusals for rollout.tensor_parallel_size)."""
    return (
        c.resources.rollout_workers == 0
        and c.trainer.async_mode == "off"
        and c.rollout.backend in ("auto", "native")
        and not c.rollout.server
        and not c.rollout.agent.loop
    )


def tensor_parallel_sizes(c: Config, shape: ModelShape, workers: int, above: int | None = None) -> list[int]:
    """The sizes the trainer's (or, `above` the engine's size, the engine's) tensor parallelism takes
    here (worker_models' and parallel/tensor's refusals, read from the shape)."""
    if c.model.impl == "hf" or c.actor.sequence_parallel_size > 1 or c.actor.expert_parallel_size > 1:
        return []  # transformers' modules, Ulysses, experts split over data-parallel ranks
    return [
        tp
        for tp in (2, 4, 8)
        if tp > (c.actor.tensor_parallel_size if above is None else above)
        and workers % tp == 0
        and shape.heads % tp == 0
        and shape.kv_heads % tp == 0
        and (shape.experts % tp == 0 if shape.experts else shape.intermediate % tp == 0)
    ]


def _largest_micro_batch(c: Config, shape, gpu_bytes, workers, limit) -> int | None:
    """The largest multiple of MICRO_STEP tokens, down to one whole sequence, at which every phase fits."""
    context = c.data.max_prompt_tokens + c.data.max_response_tokens
    floor = -(-context // MICRO_STEP) * MICRO_STEP
    micro = (c.actor.max_tokens_per_microbatch // MICRO_STEP) * MICRO_STEP
    while micro >= floor:
        plan = estimate(
            _with(c, {"actor.max_tokens_per_microbatch": micro}), shape, gpu_bytes=gpu_bytes, workers=workers
        )
        if _fits(plan, limit):
            return micro
        micro -= MICRO_STEP
    return None


def _why_not(c: Config, shape: ModelShape, plan: MemoryPlan | None, limit: float) -> str:
    engine = (plan.resident.get("engine weights") if plan else None) or engine_bytes(shape)
    if engine + CUDA_CONTEXT > limit:
        split = c.rollout.tensor_parallel_size
        return (
            f"the rollout engine's copy of the model takes {engine / GIB:.1f} GiB of one GPU"
            + (
                f" split over {split}"
                if split > 1
                else " (whole: it splits with actor.tensor_parallel_size, "
                "which offload does not combine with)"
            )
            + "; more GPUs (a larger tensor-parallel size), or GPUs with more memory"
        )
    worst = max(plan.phases, key=plan.phases.get) if plan else "?"
    if worst == "load":
        return (
            f"loading holds whole copies of the models on each GPU before FSDP2 shards them "
            f"({plan.phases['load'] / GIB:.1f} GiB: the policy, the reference, the critic, the engine's "
            "copy; only a safetensors checkpoint of a dense family, model.path a transformers directory, "
            "is read shard by shard): GPUs with more memory, or model.dtype=bfloat16"
        )
    return (
        f"{worst} is over even with everything offloaded: more GPUs (FSDP2 shards the trained models "
        "over all of them), GPUs with more memory, or a shorter context (data.max_prompt_tokens + "
        "data.max_response_tokens)"
    )


def _refused(c: Config, workers: int, hf_config) -> str | None:
    """Why training would refuse `c` (None: it would not): the start's checks, and with `hf_config`
    what the workers would refuse of the parallel sizes."""
    from hybridflow.controller.setup import check_config
    from hybridflow.controller.worker_models import check_parallel_sizes

    try:
        check_config(c, workers)
        if hf_config is not None:
            check_parallel_sizes(c, workers, hf_config)
    except UserError as e:
        return str(e)
    return None


def _fits(plan: MemoryPlan, limit: float) -> bool:
    return max(plan.phases.values()) <= limit


def _with(c: Config, settings: dict[str, object]) -> Config:
    """`c` with our dotted keys set (sections are dataclasses)."""
    for key, value in settings.items():
        section, field = key.split(".")
        c = replace(c, **{section: replace(getattr(c, section), **{field: value})})
    return c


def plan_run(config: Config) -> int | None:
    """Once, before the workers start (on a GPU): the memory plan's start-up line, a warning naming the
    fixes when a phase will not fit (with the layout `hybridflow plan` would choose), and the KV pool's
    size in tokens for an engine that keeps its pool beside training (None: the engine sizes its own),
    which the workers are given. Stops with one line when not even one sequence would fit the pool."""
    try:
        shape, gpu_bytes, workers = plan_inputs(config)
        plan = estimate(config, shape, gpu_bytes=gpu_bytes, workers=workers)
    except Exception as e:  # an estimate must never stop a run: the engine sizes its pool as usual
        print(f"memory plan unavailable for this model ({type(e).__name__}: {e})", flush=True)
        return None
    print(plan.summary(), flush=True)
    if not plan.fits():
        print(
            "warning: a phase will not fit in GPU memory (`hybridflow plan` for the details): "
            + "; ".join(plan.suggestions),
            flush=True,
        )
        print(choose_layout(config, shape, gpu_bytes=gpu_bytes, workers=workers).report(), flush=True)
    return pool_tokens_beside_training(config, plan)
