"""Advantage estimators: pure functions, response-aligned tensors, verl's definitions.

Shapes: B sequences, T response positions. `response_mask` [B, T] is 1 on generated tokens.
`scores` [B] is one outcome score per sequence; `token_rewards` [B, T] puts rewards on tokens
(usually the score on the last response token). `group_ids` [B] (int tensor or list of hashables)
marks samples of the same prompt. Every estimator returns `(advantages [B, T], returns [B, T])`,
zero outside the mask.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

Groups = torch.Tensor | Sequence[Hashable]


def group_index(group_ids: Groups, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to 0..G-1 in order of first appearance: (index [B] int64, G)."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    first: dict[Hashable, int] = {}
    index = [first.setdefault(g, len(first)) for g in ids]
    return torch.tensor(index, dtype=torch.long, device=device), len(first)


def group_stats(scores: torch.Tensor, group_ids: Groups) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group mean, unbiased group std, group size), each [B]. Groups of one: mean 0, std 1
    (verl's convention, so a lone sample keeps its raw score)."""
    index, num_groups = group_index(group_ids, scores.device)
    s = scores.float()  # [B]
    count = torch.zeros(num_groups, device=s.device).index_add_(0, index, torch.ones_like(s))  # [G]
    mean = torch.zeros(num_groups, device=s.device).index_add_(0, index, s) / count  # [G]
    sq = torch.zeros(num_groups, device=s.device).index_add_(0, index, (s - mean[index]) ** 2)  # [G]
    std = torch.sqrt(sq / (count - 1).clamp(min=1))  # [G], unbiased
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[index], std[index], count[index]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over masked entries, with the unbiased variance (verl)."""
    mask = mask.to(values.dtype)
    n = mask.sum()
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask) * (n / (n - 1).clamp(min=1))
    return (values - mean) * torch.rsqrt(var + eps)


def _broadcast(per_seq: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None] * response_mask  # [B, T]


def grpo(
    scores: torch.Tensor,
    group_ids: Groups,
    response_mask: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, DeepSeekMath): A = (s - mean_G) / (std_G + eps), unbiased std.
    `norm_by_std=False` is Dr.GRPO (Liu et al. 2025): A = s - mean_G. A group of one: mean 0, std 1."""
    mean, std, _ = group_stats(scores, group_ids)  # [B] each
    adv = scores.float() - mean
    if norm_by_std:
        adv = adv / (std + eps)
    adv = _broadcast(adv, response_mask)
    return adv, adv


def grpo_passk(
    scores: torch.Tensor,
    group_ids: Groups,
    response_mask: torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Thrampoulidis et al. 2025): only the best sample of a group (first on ties) gets
    r_max - r_second, divided by (std_G + eps) when `norm_by_std`; every other sample gets 0.
    A group of one has no second sample and gets 0."""
    s = scores.float()  # [B]
    index, num_groups = group_index(group_ids, s.device)
    b = torch.arange(s.numel(), device=s.device)
    neg_inf = torch.full((num_groups,), float("-inf"), device=s.device)
    best = neg_inf.scatter_reduce(0, index, s, "amax")  # [G]
    first_best = torch.full((num_groups,), s.numel(), device=s.device, dtype=torch.long)
    first_best = first_best.scatter_reduce(
        0, index, torch.where(s == best[index], b, s.numel()), "amin"
    )  # [G]
    is_top = b == first_best[index]  # [B]
    second = neg_inf.scatter_reduce(0, index, torch.where(is_top, float("-inf"), s), "amax")  # [G]
    gap = best - second  # [G]; -inf... -> inf for groups of one
    _, std, count = group_stats(s, group_ids)
    adv_top = gap[index]
    if norm_by_std:
        adv_top = adv_top / (std + eps)
    adv = torch.where(is_top & (count > 1), adv_top, torch.zeros_like(s))
    adv = _broadcast(adv, response_mask)
    return adv, adv


def rloo(
    scores: torch.Tensor, group_ids: Groups, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean_{j != i} s_j = n/(n-1) (s_i - mean_G).
    A group of one has no baseline and gets 0 (verl leaves its raw score; we do not reward lone samples)."""
    s = scores.float()
    mean, _, count = group_stats(s, group_ids)
    adv = torch.where(count > 1, (s - mean) * count / (count - 1).clamp(min=1), torch.zeros_like(s))
    adv = _broadcast(adv, response_mask)
    return adv, adv


def opo(
    scores: torch.Tensor, group_ids: Groups, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): length-weighted baseline b_G = sum |o| s / sum |o|; A = s - b_G.
    A group of one: baseline 0."""
    s = scores.float()
    lengths = response_mask.float().sum(-1)  # [B]
    index, num_groups = group_index(group_ids, s.device)
    num = torch.zeros(num_groups, device=s.device).index_add_(0, index, lengths * s)
    den = torch.zeros(num_groups, device=s.device).index_add_(0, index, lengths)
    count = torch.zeros(num_groups, device=s.device).index_add_(0, index, torch.ones_like(s))
    baseline = torch.where(count > 1, num / den.clamp(min=1e-12), torch.zeros_like(num))[index]
    adv = _broadcast(s - baseline, response_mask)
    return adv, adv


def gpg(
    scores: torch.Tensor, group_ids: Groups, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): A = alpha (s - mean_G) with alpha = B / max(1, #nonzero scores)."""
    s = scores.float()
    mean, _, _ = group_stats(s, group_ids)
    alpha = s.numel() / max(1, int(torch.count_nonzero(s)))
    adv = _broadcast(alpha * (s - mean), response_mask)
    return adv, adv


def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """G_t = r_t + gamma G_{t'} over the policy's tokens, t' the next masked-in position: a span the
    policy did not sample (a tool's output between turns) carries the return across it undiscounted
    (verl's REINFORCE++ since its multi-turn fix); trailing padding stays 0, as the scan starts at 0.
    With contiguous masks (single-turn) this is the running return reset after the response."""
    mask = response_mask.float()
    returns = torch.zeros_like(token_rewards, dtype=torch.float32)  # [B, T]
    running = torch.zeros(token_rewards.shape[0], device=token_rewards.device)  # [B]
    for t in reversed(range(token_rewards.shape[1])):
        stepped = token_rewards[:, t].float() + gamma * running
        running = mask[:, t] * stepped + (1 - mask[:, t]) * running  # [B]
        returns[:, t] = running
    return returns


def reinforce_plus_plus(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, *, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns G, A = whiten_batch(G) on the mask."""
    returns = discounted_returns(token_rewards, response_mask, gamma)
    adv = masked_whiten(returns, response_mask) * response_mask
    return adv, returns * response_mask


def reinforce_plus_plus_baseline(
    scores: torch.Tensor, group_ids: Groups, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: subtract the group mean (group of one: 0), tile over tokens, whiten
    over the batch's masked tokens."""
    s = scores.float()
    mean, _, _ = group_stats(s, group_ids)
    tiled = _broadcast(s - mean, response_mask)  # [B, T]
    adv = masked_whiten(tiled, response_mask) * response_mask
    return adv, adv


def remax(
    token_rewards: torch.Tensor, baselines: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): returns = reverse cumsum of masked rewards; A = returns - b, where b [B]
    is the reward of the greedy response to the same prompt."""
    returns = (token_rewards.float() * response_mask).flip(-1).cumsum(-1).flip(-1)  # [B, T]
    adv = returns - baselines.float()[:, None] * response_mask
    return adv * response_mask, returns * response_mask


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1};
    returns = A + V (before whitening); A is then whitened over the batch's masked tokens.
    Positions outside the mask are skipped (V and A carry across them, as in verl)."""
    rewards, values, mask = token_rewards.float(), values.float(), response_mask.float()
    B, T = rewards.shape
    next_value = torch.zeros(B, device=rewards.device)  # [B]
    last_adv = torch.zeros(B, device=rewards.device)  # [B]
    adv = torch.zeros_like(rewards)  # [B, T]
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step_adv = delta + gamma * lam * last_adv
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_adv = step_adv * mask[:, t] + (1 - mask[:, t]) * last_adv
        adv[:, t] = last_adv
    returns = (adv + values) * mask
    return masked_whiten(adv, mask) * mask, returns
