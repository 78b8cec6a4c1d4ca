"""What an asynchronous run (trainer.async_mode one_step / streaming) needs, checked at start."""

from __future__ import annotations

import math

from hybridflow.config import Config
from hybridflow.errors import UserError


def max_staleness(config: Config) -> float:
    """rollout.max_staleness resolved: 0 for async_mode=off, 1 by default otherwise."""
    bound = config.rollout.max_staleness
    return (0 if config.trainer.async_mode == "off" else 1) if bound is None else float(bound)


def pauses_for_training(config: Config) -> bool:
    """rollout.pause_for_training resolved: by default a streaming run's in-process engine pauses."""
    pause = config.rollout.pause_for_training
    if pause is None:
        return config.trainer.async_mode == "streaming" and not config.resources.rollout_workers
    return pause


def engine_batch_note(config: Config, *, on_gpu: bool) -> str | None:
    """A note for a streaming run whose engine, pausing for the trainer on a GPU, runs fewer sequences
    together than admission lets in: the next steps' groups then wait instead of filling the batch
    beside a step's long tail, where the pausing engine's gain comes from (docs/benchmarks.md)."""
    c = config
    if c.trainer.async_mode != "streaming" or not on_gpu or not pauses_for_training(c):
        return None
    admitted = math.ceil(c.data.prompts_per_step * c.rollout.samples_per_prompt * (1 + max_staleness(c)))
    if c.rollout.max_batch_sequences >= admitted:
        return None
    return (
        f"note: rollout.max_staleness={max_staleness(c):g} admits up to {admitted} sequences at once and the "
        f"engine runs rollout.max_batch_sequences={c.rollout.max_batch_sequences} of them together; "
        f"rollout.max_batch_sequences={admitted} lets the next steps' groups fill its batch beside a step's "
        "long tail (what pausing for the trainer gains)"
    )


def check_async(config: Config) -> None:
    mode, bound = config.trainer.async_mode, config.rollout.max_staleness
    if bound is not None and bound < 0:
        raise UserError(f"config rollout.max_staleness={bound} must be >= 0")
    if config.rollout.pause_for_training and mode != "streaming":
        raise UserError(
            f"rollout.pause_for_training=true pauses a streaming run's engine for the trainer; with "
            f"trainer.async_mode={mode} it would leave nothing overlapped: use trainer.async_mode=streaming, "
            "or drop it"
        )
    if config.rollout.keep_kv_on_weight_update and mode != "streaming":
        raise UserError(
            f"rollout.keep_kv_on_weight_update=true keeps the K/V of sequences in flight across a weight "
            f"update; with trainer.async_mode={mode} none is in flight at an update: use "
            "trainer.async_mode=streaming, or drop it"
        )
    if mode == "off":
        if bound:
            raise UserError(
                f"rollout.max_staleness={bound} bounds an asynchronous run; set trainer.async_mode=streaming "
                "(or one_step for a bound of 1), or drop it"
            )
        return
    if mode == "one_step" and bound is not None and bound > 1:
        raise UserError(
            f"trainer.async_mode=one_step trains each batch one update late (rollout.max_staleness <= 1, "
            f"not {bound}); use trainer.async_mode=streaming for a larger bound"
        )
