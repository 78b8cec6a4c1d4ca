"""Built-in rollout engine: paged KV cache, continuous batching, shared prompts, CUDA graphs."""

from hybridflow.engine.engine import Engine, EngineConfig

__all__ = ["Engine", "EngineConfig"]
