"""KL estimators between the policy and the reference, and KL coefficient controllers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def _k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


def _k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


def _k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # Schulman's low-variance estimator r - log r - 1 with r = p_ref / p, clamped as verl does
    log_ratio = torch.clamp(ref_logp - logp, -20, 20)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10, 10)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "kl": _k1,
    "abs": _abs,
    "k2": _k2,
    "mse": _k2,
    "k3": _k3,
    "low_var_kl": _k3,
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate [B, T] of KL(pi || pi_ref) from the log-probs of sampled tokens.

    k1 (alias kl): log p - log p_ref.  abs: |k1|.  k2 (alias mse): (k1)^2 / 2.
    k3 (alias low_var_kl): r - log r - 1 with r = p_ref / p (log r clamped to [-20, 20], result to [-10, 10]).
    A '+' suffix (k1+, k2+, k3+, ...) is straight-through: the value of the estimator, the gradient of k2,
    which is unbiased for the gradient of the KL (Schulman 2020; verl's "k3+").
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(
            f"unknown KL estimator {kind!r}; choose one of {', '.join(KL_ESTIMATORS)} (+ for straight-through)"
        )
    value = KL_ESTIMATORS[base](logp, ref_logp)
    if not straight_through:
        return value
    grad_source = _k2(logp, ref_logp)
    return grad_source - grad_source.detach() + value.detach()


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Ziegler et al. 2019: beta <- beta (1 + clip(KL/target - 1, -0.2, 0.2) n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]
