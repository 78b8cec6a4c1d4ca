"""Preference and supervised losses on sequence log-probs: DPO family, KTO, SimPO, ORPO, SFT.

Inputs are per-sequence log-probs [B] (sum over response tokens unless a docstring says average).
Each loss divides by `global_seqs` when given (the count over all micro-batches and ranks), so
summing the pieces of a split batch gives the loss of the whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Metrics = dict[str, torch.Tensor]


def _mean(x: torch.Tensor, global_seqs: int | float | None) -> torch.Tensor:
    return x.sum() / (x.numel() if global_seqs is None else global_seqs)


def _reward_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> Metrics:
    """rewards/{chosen,rejected,accuracies,margins} from implicit per-pair rewards [B] (detached)."""
    return {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/accuracies": (chosen > rejected).float().mean(),
        "rewards/margins": (chosen - rejected).mean(),
    }


def _sigmoid(logits, beta, ls):
    return -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls


def _robust(logits, beta, ls):
    # Chowdhury et al. 2024: unbiased under label noise rate ls
    return (-F.logsigmoid(beta * logits) * (1 - ls) + F.logsigmoid(-beta * logits) * ls) / (1 - 2 * ls)


def _hinge(logits, beta, ls):
    return torch.relu(1 - beta * logits)  # SLiC (Zhao et al. 2023)


def _ipo(logits, beta, ls):
    return (logits - 1 / (2 * beta)) ** 2  # Azar et al. 2023; pass length-averaged log-probs as in the paper


DPO_VARIANTS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": _sigmoid,
    "robust": _robust,
    "hinge": _hinge,
    "ipo": _ipo,
}


def dpo_loss(
    pi_chosen: torch.Tensor,
    pi_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    kind: str = "sigmoid",
    global_seqs: int | float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """DPO (Rafailov et al. 2023) and variants on h = (pi_c - pi_r) - (ref_c - ref_r):
    sigmoid: -(1-e) log s(beta h) - e log s(-beta h);  robust: (-(1-e) log s(beta h) + e log s(-beta h)) / (1-2e);
    hinge: max(0, 1 - beta h);  ipo: (h - 1/(2 beta))^2.
    Metrics: rewards/chosen, rewards/rejected (beta x policy-reference log-ratio), accuracies, margins."""
    if kind not in DPO_VARIANTS:
        raise ValueError(f"unknown DPO loss {kind!r}; choose one of {', '.join(DPO_VARIANTS)}")
    logits = (pi_chosen - pi_rejected) - (ref_chosen - ref_rejected)  # [B]
    losses = DPO_VARIANTS[kind](logits, beta, label_smoothing)
    metrics = _reward_metrics(
        beta * (pi_chosen - ref_chosen).detach(), beta * (pi_rejected - ref_rejected).detach()
    )
    return _mean(losses, global_seqs), metrics


def kto_loss(
    pi_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    is_desirable: torch.Tensor,
    kl_estimate: torch.Tensor | float,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    global_seqs: int | float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """KTO (Ethayarajh et al. 2024): with r = pi - ref and z0 = max(0, KL estimate) (no gradient),
    desirable: w_d (1 - s(beta (r - z0)));  undesirable: w_u (1 - s(beta (z0 - r)))."""
    z0 = torch.as_tensor(kl_estimate, dtype=pi_logps.dtype, device=pi_logps.device).detach().clamp(min=0)
    ratio = pi_logps - ref_logps  # [B]
    good = is_desirable.bool()
    losses = torch.where(
        good,
        desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0))),
        undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio))),
    )
    rewards = beta * ratio.detach()
    nan = torch.tensor(float("nan"), device=ratio.device)
    metrics = {
        "rewards/chosen": rewards[good].mean() if good.any() else nan,
        "rewards/rejected": rewards[~good].mean() if (~good).any() else nan,
        "kl": z0,
    }
    return _mean(losses, global_seqs), metrics


def simpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
    label_smoothing: float = 0.0,
    global_seqs: int | float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """SimPO (Meng et al. 2024), reference-free, on length-averaged log-probs:
    -(1-e) log s(beta (c - r) - gamma) - e log s(-(beta (c - r) - gamma))."""
    logits = beta * (chosen_avg_logps - rejected_avg_logps) - gamma  # [B]
    losses = -F.logsigmoid(logits) * (1 - label_smoothing) - F.logsigmoid(-logits) * label_smoothing
    metrics = _reward_metrics(beta * chosen_avg_logps.detach(), beta * rejected_avg_logps.detach())
    return _mean(losses, global_seqs), metrics


def orpo_loss(
    chosen_avg_logps: torch.Tensor,
    rejected_avg_logps: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
    global_seqs: int | float | None = None,
) -> tuple[torch.Tensor, Metrics]:
    """ORPO (Hong et al. 2024): L = NLL(chosen) - beta log s(log odds(c) - log odds(r)), with
    log odds(y) = log p - log(1 - p) on length-averaged log-probs p = exp(avg log-prob).
    `chosen_nll` [B] is each chosen response's mean token NLL."""
    log_odds = (chosen_avg_logps - rejected_avg_logps) - (
        torch.log1p(-torch.exp(chosen_avg_logps).clamp(max=1 - 1e-7))
        - torch.log1p(-torch.exp(rejected_avg_logps).clamp(max=1 - 1e-7))
    )  # [B]
    ratio_term = F.logsigmoid(log_odds)
    losses = chosen_nll - beta * ratio_term
    metrics = {
        "log_odds_ratio": ratio_term.detach().mean(),
        "log_odds_chosen": log_odds.detach().mean(),
        "nll_loss": chosen_nll.detach().mean(),
    }
    return _mean(losses, global_seqs), metrics


def sft_loss(
    logp: torch.Tensor, loss_mask: torch.Tensor, *, global_tokens: int | float | None = None
) -> torch.Tensor:
    """Token-mean negative log-likelihood: -sum(m log p) / N_tokens (global when given)."""
    mask = loss_mask.to(logp.dtype)
    denom = mask.sum().clamp(min=1) if global_tokens is None else global_tokens
    return -(logp * mask).sum() / denom
