"""hybridflow: RL post-training of LLMs in the HybridFlow programming model."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

API = (
    "DAPOConfig", "DAPOTrainer", "GRPOConfig", "GRPOTrainer", "PPOConfig", "PPOTrainer", "RLConfig", "RLOOConfig",
    "RLOOTrainer", "ReinforcePPConfig", "ReinforcePPTrainer",
)  # fmt: skip
OFFLINE = ("SFTTrainer", "DPOTrainer", "KTOTrainer")
OFFLINE_CONFIGS = ("SFTConfig", "DPOConfig", "KTOConfig")

if TYPE_CHECKING:
    from hybridflow.api import (
        DAPOConfig,
        DAPOTrainer,
        GRPOConfig,
        GRPOTrainer,
        PPOConfig,
        PPOTrainer,
        ReinforcePPConfig,
        ReinforcePPTrainer,
        RLConfig,
        RLOOConfig,
        RLOOTrainer,
    )
    from hybridflow.api.offline import DPOConfig, KTOConfig, SFTConfig
    from hybridflow.config import Config, load_config
    from hybridflow.controller.trainer import RLTrainer
    from hybridflow.offline import DPOTrainer, KTOTrainer, SFTTrainer

__all__ = [
    "Config", "DAPOConfig", "DAPOTrainer", "DPOConfig", "DPOTrainer", "GRPOConfig", "GRPOTrainer",
    "KTOConfig", "KTOTrainer", "PPOConfig", "PPOTrainer", "RLConfig", "RLOOConfig", "RLOOTrainer",
    "RLTrainer", "ReinforcePPConfig", "ReinforcePPTrainer", "SFTConfig", "SFTTrainer", "load_config",
    "__version__",
]  # fmt: skip


def __getattr__(name: str) -> Any:
    # Lazy so `import hybridflow` stays cheap (no torch import for `hybridflow --help`).
    if name in ("Config", "load_config"):
        from hybridflow import config

        return getattr(config, name)
    if name == "RLTrainer":
        from hybridflow.controller.trainer import RLTrainer

        return RLTrainer
    if name in API:
        from hybridflow import api

        return getattr(api, name)
    if name in OFFLINE_CONFIGS:
        from hybridflow.api import offline as offline_configs

        return getattr(offline_configs, name)
    if name in OFFLINE:
        from hybridflow import offline

        return getattr(offline, name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
