"""Rewards: rule scorers dispatched by data_source, custom functions, and their execution."""

from hybridflow.rewards.scorers import SCORERS, compute_score

__all__ = ["SCORERS", "compute_score"]
