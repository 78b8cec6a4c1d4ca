"""A GPU that runs out of memory during a run, as one line: where (step and phase), what torch says of
the device, what the memory plan expected of that phase, and which settings give it room. The traceback
stays one `--debug` away: an out-of-memory error is the run's size against the GPU, not a bug to read."""

from __future__ import annotations

import re

import torch

from hybridflow.config.schema import Config
from hybridflow.controller.watchdog import Watchdog
from hybridflow.controller.worker_group import WorkerError
from hybridflow.controller.worker_models import WorkerLayout
from hybridflow.errors import UserError
from hybridflow.plan.memory import GIB, plan_for, pool_beside_training

# the trainer's phase names -> the memory plan's
PLAN_PHASE = {
    "gen": "gen", "validation": "gen", "old_log_prob": "ref/old_log_prob", "ref": "ref/old_log_prob",
    "values": "ref/old_log_prob", "update_actor": "update_actor", "update_critic": "update_critic",
    "update_weights": "update_weights",
}  # fmt: skip


class RanOutOfMemory(UserError):
    """The GPU ran out of memory in a phase of a step: one line, exit code 2."""


def ran_out_of_memory(
    config: Config, watchdog: Watchdog, step: int, error: BaseException
) -> RanOutOfMemory | None:
    """The one-line error for `error` if it is a GPU out of memory (here, or in a Ray worker, whose
    WorkerError carries the worker's traceback: a restart would run out again), else None."""
    remote = isinstance(error, WorkerError) and "OutOfMemoryError: CUDA out of memory" in str(error)
    if not (isinstance(error, torch.OutOfMemoryError) or remote):
        return None
    failed = watchdog.failed
    where, phase = failed[:2] if failed and failed[2] == id(error) else (f"step {step}", None)
    if remote:
        where += f", {str(error).split(chr(10))[0].removesuffix(':')}"  # 'worker rank 1 raised'
    return RanOutOfMemory(out_of_memory_line(config, where, phase, error))


def out_of_memory_line(config: Config, where: str, phase: str | None, error: BaseException) -> str:
    """`where` (the watchdog's 'step N: phase X'), `phase` (the innermost phase's name), torch's
    OutOfMemoryError -> the line."""
    said = re.search(r"Tried to allocate ([\d.]+ \w+)\. GPU \d+ has a total capacity of ([\d.]+ \w+) of "
                     r"which ([\d.]+ \w+) is free", str(error))  # fmt: skip
    device = f"{said[1]} asked with {said[3]} free of {said[2]}" if said else str(error).split("\n")[0][:200]
    planned = PLAN_PHASE.get(phase or "")
    expected, fixes = "", _fixes(config, planned)
    if phase == "reward":  # a reward model's forward: no phase of the plan
        fixes = [
            f"reward.model_max_tokens_per_microbatch below {config.reward.model_max_tokens_per_microbatch}"
        ]
    try:
        plan = plan_for(config)
        workers = max(plan.workers, 1)
        if planned in plan.phases:
            expected = f"; the memory plan put {planned} at {plan.phases[planned] / GIB:.1f} GiB of {plan.gpu_bytes / GIB:.1f}"
            if plan.phases[planned] > plan.gpu_bytes and plan.suggestions:  # it said so at the start
                settings = [s.split(" (")[0] for s in plan.suggestions if re.match(r"[\w.]+=\S", s)]
                fixes = settings or fixes
        if pool_beside_training(config, WorkerLayout.of(config, workers)) and planned != "gen":
            expected += f" with the KV pool ({plan.kv_tokens:,} tokens) kept beside it"
            fixes.insert(0, f"rollout.kv_cache_tokens below {plan.kv_tokens:,}")
    except Exception as e:  # no plan for this model: the line still says where and what to lower
        expected = f"; no memory plan for this model ({type(e).__name__})"
    return (
        f"{where}: the GPU ran out of memory ({device}){expected}: set {' or '.join(fixes)} "
        "(`hybridflow plan` shows each phase; --debug shows the traceback)"
    )


def _fixes(config: Config, planned: str | None) -> list[str]:
    c = config
    if planned == "gen":
        return [
            f"rollout.gpu_memory_utilization below {c.rollout.gpu_memory_utilization}",
            f"rollout.max_batch_sequences below {c.rollout.max_batch_sequences}",
        ]
    if planned == "update_critic":
        return [f"critic.max_tokens_per_microbatch below {c.critic.max_tokens_per_microbatch}"]
    fixes = []
    if planned == "ref/old_log_prob":
        fixes.append(f"ref.max_tokens_per_microbatch below {c.ref.max_tokens_per_microbatch}")
    fixes.append(f"actor.max_tokens_per_microbatch below {c.actor.max_tokens_per_microbatch}")
    if planned == "update_actor" and not c.model.enable_gradient_checkpointing:
        fixes.append("model.enable_gradient_checkpointing=true")
    if not c.actor.offload_optimizer:
        fixes.append("actor.offload_optimizer=true")
    return fixes
