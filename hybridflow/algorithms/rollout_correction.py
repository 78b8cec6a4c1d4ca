"""Off-policy corrections between the policy that sampled a batch (the rollout engine's, possibly
several updates old in an asynchronous run, or numerically different) and the one that trains on it,
under verl's names (algorithm.rollout_correction): truncated importance weights at the token or
sequence level, and rejection of tokens or whole sequences whose divergence passes a threshold.

log_ratio = log pi_old - log pi_rollout, per response token, where pi_old is the proximal policy (the
trainer's log-probs before the update: decoupled PPO) or, in bypass mode, the rollout policy itself."""

from __future__ import annotations

import math

import torch

from hybridflow.algorithms.losses import truncated_importance_weights

LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: past it a ratio carries no more information, only overflow

# option -> (level, divergence, reduction); k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = e^r - 1 - r
REJECTION_OPTIONS = {
    f"{level}_{k}": (level, k)
    for level in ("token", "seq_sum", "seq_mean", "seq_max")
    for k in ("k1", "k2", "k3")
    if not (level == "seq_max" and k == "k1")
}


def divergences(log_ratio: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-token estimators [B, T] of KL(rollout || old) verl's options threshold."""
    r = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return {"k1": -r, "k2": 0.5 * r**2, "k3": torch.expm1(r) - r}


def parse_thresholds(options: list[str], spec: str | float | int) -> dict[str, tuple[float | None, float]]:
    """`spec`: one entry shared by all options or one per option, comma-separated; a k1 option takes
    'lower_upper' (ratio bounds, e.g. '0.5_2.0'), the others one upper bound. -> option: (lower, upper)."""
    entries = [str(spec)] if not isinstance(spec, str) else [e.strip() for e in spec.split(",") if e.strip()]
    if len(entries) not in (1, len(options)):
        raise ValueError(
            f"rollout_rs_threshold {spec!r} has {len(entries)} entries for {len(options)} rollout_rs options; "
            "give one shared entry or one per option"
        )
    out: dict[str, tuple[float | None, float]] = {}
    for option, entry in zip(options, entries * len(options) if len(entries) == 1 else entries):
        parts = [float(x) for x in entry.split("_")]
        if option.endswith("k1"):
            if len(parts) != 2 or not 0 < parts[0] < parts[1]:
                raise ValueError(
                    f"rollout_rs_threshold for {option} is {entry!r}; a k1 option takes 'lower_upper' ratio "
                    "bounds with 0 < lower < upper, e.g. '0.5_2.0' (quoted: YAML reads 0.5_2 as 0.52)"
                )
            out[option] = (math.log(parts[0]), math.log(parts[1]))
        else:
            if len(parts) != 1 or parts[0] <= 0:
                raise ValueError(
                    f"rollout_rs_threshold for {option} is {entry!r}; it takes one positive upper bound"
                )
            out[option] = (None, parts[0])
    return out


def parse_options(spec: str) -> list[str]:
    options = list(dict.fromkeys(o.strip() for o in spec.split(",") if o.strip()))
    unknown = [o for o in options if o not in REJECTION_OPTIONS]
    if unknown or not options:
        raise ValueError(
            f"rollout_rs={spec!r}: unknown option {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(REJECTION_OPTIONS)} (comma-separated to combine)"
        )
    return options


def rejection_mask(
    log_ratio: torch.Tensor, mask: torch.Tensor, options: str, thresholds: str | float
) -> tuple[torch.Tensor, dict[str, float]]:
    """[B, T] 1 where every option keeps the token, 0 where one rejects it (a sequence option rejects
    all of a sequence's tokens), times `mask`; and the fraction rejected per option."""
    names = parse_options(options)
    bounds = parse_thresholds(names, thresholds)
    mask = mask.to(log_ratio.dtype)
    per_token = divergences(log_ratio)
    tokens = mask.sum(-1).clamp(min=1)  # [B]
    keep = torch.ones_like(mask, dtype=torch.bool)
    metrics: dict[str, float] = {}
    for name in names:
        level, k = REJECTION_OPTIONS[name]
        lower, upper = bounds[name]
        values = per_token[k] * mask  # [B, T]
        if level == "seq_sum":
            values = values.sum(-1, keepdim=True)
        elif level == "seq_mean":
            values = values.sum(-1, keepdim=True) / tokens[:, None]
        elif level == "seq_max":
            values = values.masked_fill(mask == 0, float("-inf")).amax(-1, keepdim=True)
        # k1 bounds a log ratio from both sides (the statistic is -log_ratio, so the bounds flip)
        ok = (values >= -upper) & (values <= -lower) if lower is not None else values <= upper
        ok = ok.expand_as(mask)
        rejected = ((~ok) & (mask > 0)).sum().item()
        metrics[f"rollout_corr/{name}_rejected_fraction"] = rejected / max(mask.sum().item(), 1)
        keep &= ok
    kept = keep.to(mask.dtype) * mask
    metrics["rollout_corr/rejected_fraction"] = 1.0 - kept.sum().item() / max(mask.sum().item(), 1)
    return kept, metrics


def importance_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    threshold: float,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated IS weights [B, T] (token: per token; sequence: the product over the sequence), optionally
    scaled to mean 1 over the masked tokens; and their mean and the fraction truncated."""
    weights = truncated_importance_weights(old_logp, rollout_logp, mask, cap=threshold, level=level)
    m = mask.to(weights.dtype)
    tokens = m.sum().clamp(min=1)
    mean = (weights * m).sum() / tokens
    truncated = ((weights >= threshold) & (m > 0)).sum() / tokens
    if batch_normalize and mean > 0:
        weights = weights / mean
    return weights, {
        "rollout_corr/is_weight_mean": mean.item(),
        "rollout_corr/is_truncated_fraction": truncated.item(),
    }
