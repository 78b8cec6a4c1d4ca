"""Offline trainers on the same model code, roles and checkpoint format as RL: SFT (`hybridflow sft`)."""

from hybridflow.offline.sft import SFTTrainer

__all__ = ["SFTTrainer"]
