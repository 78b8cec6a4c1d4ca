"""Typed configuration (schema.py), verl aliases (aliases.py), loading and overrides (loader.py)."""

from hybridflow.config.loader import load_config, resolve_recipe, to_dict, to_yaml, valid_keys
from hybridflow.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    ModelConfig,
    RefConfig,
    ResourcesConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "RefConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "load_config",
    "resolve_recipe",
    "to_dict",
    "to_yaml",
    "valid_keys",
]
