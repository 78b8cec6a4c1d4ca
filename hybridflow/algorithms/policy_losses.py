"""Policy-gradient losses, one small function per variant, chosen by name from `POLICY_LOSSES`.

Each variant maps (logp, old_logp, advantages, mask) [B, T] to a per-token loss matrix and metrics;
`policy_loss` then applies importance weights and the aggregation, so every variant shares the
split-invariant denominators of `aggregate`. A variant may ask for its own aggregation (GSPO is
defined with seq-mean-token-mean) or return a per-sequence loss [B, 1] (GMPO).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.algorithms.advantages import masked_mean
from hybridflow.algorithms.aggregation import aggregate

Metrics = dict[str, torch.Tensor]


@dataclass
class LossParams:
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class VariantOutput:
    loss_mat: torch.Tensor
    """[B, T] per-token loss, or [B, 1] per-sequence loss."""
    metrics: Metrics
    agg: str | None = None
    """Aggregation this variant is defined with (None: the caller's)."""


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return torch.clamp(logp - old_logp, -20.0, 20.0)  # [B, T]; clamped so exp never overflows


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), device=x.device)


def vanilla(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """PPO clip (Schulman et al. 2017) with clip-higher (DAPO: separate low/high ranges) and dual clip
    (Ye et al. 2020) for negative advantages: L = max(-A r, -A clip(r, 1-el, 1+eh)); for A < 0 also
    min(L, -A c)."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)  # [B, T]
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high)
    clipped = torch.maximum(loss1, loss2)
    loss3 = -adv * p.clip_c
    dual = torch.minimum(loss3, clipped)
    loss = torch.where(adv < 0, dual, clipped)
    metrics = {
        "pg_clipfrac": masked_mean((loss2 > loss1).float(), mask),
        "pg_clipfrac_lower": masked_mean(((clipped > loss3) & (adv < 0)).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return VariantOutput(loss, metrics)


def gspo(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """GSPO (Zheng et al. 2025): sequence ratio s = exp(mean_t log r_t), applied per token as
    exp(logp - sg(logp) + sg(log s)); PPO clip on it; aggregated seq-mean-token-mean."""
    log_ratio = logp - old_logp  # [B, T]
    lengths = mask.sum(-1).clamp(min=1)  # [B]
    seq_log_ratio = (log_ratio * mask).sum(-1) / lengths  # [B]
    token_log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # [B, T]
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high)
    metrics = {
        "pg_clipfrac": masked_mean((loss2 > loss1).float(), mask),
        "pg_clipfrac_lower": _zero(logp),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return VariantOutput(torch.maximum(loss1, loss2), metrics, agg="seq-mean-token-mean")


def cispo(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """CISPO (MiniMax-M1, 2025): L = -sg(clip(r, 1-el, 1+eh)) A log p — the ratio is clipped but
    every token keeps its gradient."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high)
    metrics = {
        "pg_clipfrac": masked_mean((ratio != clipped_ratio).float(), mask),
        "pg_clipfrac_lower": masked_mean((ratio < 1 - p.clip_low).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return VariantOutput(-clipped_ratio.detach() * adv * logp, metrics)


def gpg(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """GPG (Chu et al. 2025): plain policy gradient L = -A log p, no ratio, no clip."""
    metrics = {
        "pg_clipfrac": _zero(logp),
        "pg_clipfrac_lower": _zero(logp),
        "ppo_kl": masked_mean(old_logp - logp, mask),
    }
    return VariantOutput(-adv * logp, metrics)


def sapo(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """SAPO (Gao et al. 2025, Qwen): a soft gate replaces the hard clip,
    L = -A sigmoid(tau (r - 1)) 4 / tau, with tau_pos for A > 0 and tau_neg for A <= 0
    (gradient at r = 1 equals vanilla PPO's)."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    tau = torch.where(adv > 0, torch.full_like(adv, p.tau_pos), torch.full_like(adv, p.tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    metrics = {
        "pg_clipfrac": _zero(logp),
        "pg_clipfrac_lower": _zero(logp),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return VariantOutput(-gate * adv, metrics)


def _centered_cov(adv: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token covariance term (A - mean A)(log p - mean log p) over the masked tokens [B, T]."""
    return (adv - masked_mean(adv, mask)) * (logp.detach() - masked_mean(logp.detach(), mask))


def clip_cov(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """Clip-Cov (Cui et al. 2025): PPO clip, plus the gradient of a random clip_cov_ratio fraction of
    tokens whose covariance lies in (lb, ub) is cut (their loss is multiplied by 0)."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - p.clip_low, 1 + p.clip_high)
    clipped_by_ppo = (loss2 > loss1) & (mask > 0)
    cov = _centered_cov(adv, logp, mask)
    candidates = (cov > p.clip_cov_lb) & (cov < p.clip_cov_ub) & (mask > 0) & ~clipped_by_ppo
    idx = torch.nonzero(candidates)  # [K, 2]
    n_clip = max(int(p.clip_cov_ratio * mask.sum().item()), 1)
    if len(idx) > 0:
        idx = idx[torch.randperm(len(idx), generator=p.generator)[:n_clip]]
    keep = torch.ones_like(adv)
    keep[idx[:, 0], idx[:, 1]] = 0
    metrics = {
        "pg_clipfrac": masked_mean((keep == 0).float(), mask),
        "pg_clipfrac_lower": _zero(logp),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return VariantOutput(torch.maximum(loss1, loss2) * keep, metrics)


def kl_cov(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """KL-Cov (Cui et al. 2025): the kl_cov_ratio fraction of tokens with the largest covariance get a
    penalty ppo_kl_coef |log r| added to the unclipped loss -A r."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    loss = -adv * ratio
    valid = torch.nonzero(mask.reshape(-1) > 0)[:, 0]  # [V] flat indices
    if len(valid) > 0:
        cov = _centered_cov(adv, logp, mask).reshape(-1)[valid]
        k = max(1, int(len(valid) * p.kl_cov_ratio))
        chosen = valid[torch.topk(cov, k).indices]
        penalised = (loss + p.ppo_kl_coef * log_ratio.abs()).reshape(-1)
        loss = loss.reshape(-1).index_copy(0, chosen, penalised[chosen]).reshape(adv.shape)
    metrics = {
        "pg_clipfrac": _zero(logp),
        "pg_clipfrac_lower": _zero(logp),
        "ppo_kl": masked_mean(log_ratio.abs(), mask),
    }
    return VariantOutput(loss, metrics)


def geo_mean(logp, old_logp, adv, mask, p: LossParams) -> VariantOutput:
    """GMPO (Zhao et al. 2025): the geometric mean of token ratios per sequence, each token's log-ratio
    clipped to [-el, eh] in the direction of sign(A); L_b = -mean_t(A) exp(mean_t clipped log r)."""
    log_ratio = _log_ratio(logp, old_logp)
    sign = torch.sign(adv)
    clamped = torch.clamp(log_ratio, -p.clip_low, p.clip_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [B, T]
    lengths = mask.sum(-1) + 1e-8  # [B]
    seq_ratio = torch.exp((pessimistic * mask).sum(-1) / lengths)  # [B]
    seq_adv = (adv * mask).sum(-1) / lengths  # [B]
    was_clipped = log_ratio != clamped
    metrics = {
        "pg_clipfrac": masked_mean((was_clipped & (adv > 0)).float(), mask),
        "pg_clipfrac_lower": masked_mean((was_clipped & (adv < 0)).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
    }
    return VariantOutput((-seq_adv * seq_ratio)[:, None], metrics, agg="seq-mean-token-sum")


POLICY_LOSSES: dict[str, Callable[..., VariantOutput]] = {
    "vanilla": vanilla,
    "gspo": gspo,
    "cispo": cispo,
    "gpg": gpg,
    "sapo": sapo,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
    "geo_mean": geo_mean,
}


def policy_loss(
    kind: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float = 3.0,
    agg: str = "token-mean",
    importance_weights: torch.Tensor | None = None,
    global_tokens: int | float | None = None,
    global_seqs: int | float | None = None,
    scale: float | None = None,
    **kw,
) -> tuple[torch.Tensor, Metrics]:
    """Policy loss of variant `kind` (see POLICY_LOSSES) and metrics pg_clipfrac, pg_clipfrac_lower,
    ppo_kl (detached). `importance_weights` [B, T] (e.g. truncated IS for rollout/trainer mismatch)
    multiply the per-token loss. Extra keyword arguments fill LossParams (tau_pos, clip_cov_ratio, ...)."""
    if kind not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {kind!r}; choose one of {', '.join(POLICY_LOSSES)}")
    params = LossParams(clip_low=clip_low, clip_high=clip_high, clip_c=clip_c, **kw)
    mask = response_mask.to(logp.dtype)
    out = POLICY_LOSSES[kind](logp, old_logp, advantages, mask, params)
    loss_mat = out.loss_mat
    if importance_weights is not None:
        weights = importance_weights.detach()
        if loss_mat.shape[-1] == 1:  # per-sequence loss: weight by the sequence's mean token weight
            weights = ((weights * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
        loss_mat = loss_mat * weights
    agg_mask = mask if loss_mat.shape == mask.shape else (mask.sum(-1, keepdim=True) > 0).to(mask.dtype)
    loss = aggregate(
        loss_mat, agg_mask, out.agg or agg, global_tokens=global_tokens, global_seqs=global_seqs, scale=scale
    )
    return loss, {k: v.detach() for k, v in out.metrics.items()}
