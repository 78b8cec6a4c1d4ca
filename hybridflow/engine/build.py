"""The one place an engine is made (the trainer's workers, rollout workers, `hybridflow generate`,
`hybridflow serve`): its settings resolved for the device it runs on."""

from __future__ import annotations

from dataclasses import replace

import torch

from hybridflow.engine.config import EngineConfig, page_size_for, pool_tokens_for
from hybridflow.engine.engine import Engine


def build_engine(
    model: torch.nn.Module,
    *,
    eos_token_ids: list[int],
    device: torch.device,
    config: EngineConfig,
    sequences: int | None = None,
    tp_mesh=None,
) -> Engine:
    """The built-in engine over our `model` on `device`. With no KV pool size given, a CPU's pool holds
    the `sequences` that will run at once (at most max_batch_sequences) at full context: the CPU has no
    free-memory reading to take a share of, and a pool sized for more costs memory nothing uses. On a
    GPU the engine takes its share of the free memory (EngineConfig.gpu_memory_utilization)."""
    if config.kv_cache_tokens is None and device.type != "cuda" and sequences is not None:
        running = min(sequences, config.max_batch_sequences)
        config = replace(
            config, kv_cache_tokens=pool_tokens_for(running, config.max_context_tokens, page_size_for(device))
        )
    return Engine(model, eos_token_ids=eos_token_ids, config=config, device=device, tp_mesh=tp_mesh)
