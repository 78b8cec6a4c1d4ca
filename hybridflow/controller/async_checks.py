"""What an asynchronous run (trainer.async_mode one_step / streaming) needs, checked at start."""

from __future__ import annotations

from hybridflow.config import Config
from hybridflow.errors import UserError


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
