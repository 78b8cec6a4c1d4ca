"""Rollout backends: `hf` (transformers generate, the reference). The native engine lives in engine/."""

from hybridflow.rollout.hf import HFBackend
from hybridflow.rollout.sampling import Generation, SamplingParams, warp_logits

__all__ = ["Generation", "HFBackend", "SamplingParams", "warp_logits"]
