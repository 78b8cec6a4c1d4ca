"""hybridflow: RL post-training of LLMs in the HybridFlow programming model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from hybridflow.config import Config, load_config
    from hybridflow.controller.trainer import RLTrainer

__all__ = ["Config", "RLTrainer", "__version__", "load_config"]


def __getattr__(name: str) -> Any:
    # Lazy so `import hybridflow` stays cheap (no torch import for `hybridflow --help`).
    if name in ("Config", "load_config"):
        from hybridflow import config

        return getattr(config, name)
    if name == "RLTrainer":
        from hybridflow.controller.trainer import RLTrainer

        return RLTrainer
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
