"""Typed configuration: one dataclass per section. Defaults live in these dataclasses and only there.

Units are in the names: `*_tokens` count tokens, `*_prompts` count prompts, `*_sequences` count
sampled responses (prompts x samples_per_prompt). Validation in `__post_init__` names the field.
The sections live in sections_*.py; this module holds the root and is the one place to import them from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.sections_model_data import DataConfig, ModelConfig
from hybridflow.config.sections_offline import PreferenceConfig, SFTConfig
from hybridflow.config.sections_reward import OverlongBufferConfig, RewardConfig
from hybridflow.config.sections_rollout import AgentConfig, RolloutConfig, SpeculativeRolloutConfig
from hybridflow.config.sections_run import GuardsConfig, ResourcesConfig, TrainerConfig
from hybridflow.config.sections_training import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    FilterGroupsConfig,
    KLControlConfig,
    OptimConfig,
    RefConfig,
)

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DataConfig",
    "FilterGroupsConfig",
    "GuardsConfig",
    "KLControlConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PreferenceConfig",
    "RefConfig",
    "ResourcesConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "SpeculativeRolloutConfig",
    "TrainerConfig",
    "Config",
]


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model and how it is loaded and trained (LoRA, dtype, compile)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts, their files and lengths."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation: backend, sampling, engine memory, agents, the policy server."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The policy's update: loss, clipping, KL, micro-batching, offload."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy (KL terms)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model (adv_estimator=gae)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Scoring: rule functions, sandboxed code, a reward model, shaping."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator, KL in the reward, DAPO's dynamic sampling."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, validation, checkpoints, logging, resuming, guards."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """Devices, workers, placement, Ray."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised fine-tuning (`hybridflow sft`)."""
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    """DPO and KTO (`hybridflow dpo`, `hybridflow kto`)."""

    @property
    def deterministic_processes(self) -> bool:
        """torch's deterministic algorithms in every process of the run (devices.seed_process): asked for
        (trainer.deterministic), or implied by rollout.exact_logprobs, whose runs are to repeat."""
        return self.trainer.deterministic or self.rollout.exact_logprobs
