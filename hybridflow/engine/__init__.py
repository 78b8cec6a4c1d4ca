"""Built-in rollout engine: paged KV cache, continuous batching, shared prompts, CUDA graphs."""

from hybridflow.engine.build import build_engine
from hybridflow.engine.config import EngineConfig
from hybridflow.engine.engine import Engine

__all__ = ["Engine", "EngineConfig", "build_engine"]
