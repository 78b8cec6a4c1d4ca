"""The Python API: trainer classes over `RLTrainer` that take live models, datasets and reward
functions, with config dataclasses of flat keyword fields."""

from hybridflow.api.configs import DAPOConfig, GRPOConfig, PPOConfig, ReinforcePPConfig, RLConfig, RLOOConfig
from hybridflow.api.trainers import (
    DAPOTrainer,
    GRPOTrainer,
    PPOTrainer,
    ReinforcePPTrainer,
    RLOOTrainer,
    Trainer,
)

__all__ = [
    "DAPOConfig",
    "DAPOTrainer",
    "GRPOConfig",
    "GRPOTrainer",
    "PPOConfig",
    "PPOTrainer",
    "RLConfig",
    "RLOOConfig",
    "RLOOTrainer",
    "ReinforcePPConfig",
    "ReinforcePPTrainer",
    "Trainer",
]
