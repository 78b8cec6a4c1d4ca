"""Offline trainers on the same model code, roles and checkpoint format as RL: SFT, DPO (and its
variants) and KTO (`hybridflow sft|dpo|kto`)."""

from hybridflow.offline.dpo import DPOTrainer
from hybridflow.offline.kto import KTOTrainer
from hybridflow.offline.sft import SFTTrainer

__all__ = ["DPOTrainer", "KTOTrainer", "SFTTrainer"]
