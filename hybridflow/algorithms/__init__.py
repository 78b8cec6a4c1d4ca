"""Pure, typed RL math: advantage estimators, policy/value/KL losses, preference losses."""

from hybridflow.algorithms.estimators import ESTIMATORS
from hybridflow.algorithms.losses import POLICY_LOSSES, aggregate, kl_penalty, policy_loss, value_loss

__all__ = ["ESTIMATORS", "POLICY_LOSSES", "aggregate", "kl_penalty", "policy_loss", "value_loss"]
