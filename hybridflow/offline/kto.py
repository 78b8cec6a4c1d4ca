"""KTO (Ethayarajh et al. 2024) on completions labelled desirable or not. The reference point z0 is
the policy's KL from the reference estimated on mismatched pairs — each prompt with the next
example's completion, as in the paper — with no gradient; the loss divides by the step's completion
count. The reference (a frozen copy of the starting policy) runs alongside."""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from hybridflow.algorithms.preference import kto_loss
from hybridflow.api.offline import KTOConfig
from hybridflow.batch import plan_microbatches
from hybridflow.offline.base import OfflineTrainer
from hybridflow.offline.preference_data import Completion, load_completions


class KTOTrainer(OfflineTrainer):
    name = "kto"
    TRL_CONFIG = KTOConfig
    batch_setting = "preference.batch_size"

    def setup(self) -> None:
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)

    def load(self, files: list[str]) -> list[Completion]:
        return load_completions(files, self.tokenizer, self.config)

    def _microbatches(self, items: list[Completion]) -> list[list[Completion]]:
        a = self.config.actor
        lengths = [len(i.prompt) + len(i.completion) for i in items]
        return [
            [items[i] for i in rows] for rows in plan_microbatches(lengths, a.max_tokens_per_microbatch, None)
        ]

    def _logps(self, model, items: list[Completion]) -> torch.Tensor:
        """Summed log-probs of each completion after its prompt [b]."""
        return self.response_logprobs(model, [i.prompt for i in items], [i.completion for i in items]).sum(-1)

    @torch.no_grad()
    def kl_estimate(self, items: list[Completion]) -> float:
        """Mean log-ratio policy/reference over mismatched pairs (prompt i, completion i+1)."""
        shifted = [
            Completion(a.prompt, b.completion, a.desirable) for a, b in zip(items, items[1:] + items[:1])
        ]
        total = 0.0
        for micro in self._microbatches(shifted):
            total += (self._logps(self.model, micro) - self._logps(self.reference, micro)).sum().item()
        return total / len(shifted)

    def _pass(self, items: list[Completion], *, train: bool) -> dict[str, float]:
        p = self.config.preference
        z0 = self.kl_estimate(items)
        sums: dict[str, float] = defaultdict(float)
        good = sum(i.desirable for i in items)
        for micro in self._microbatches(items):
            policy = self._logps(self.model, micro)
            with torch.no_grad():
                reference = self._logps(self.reference, micro)
            desirable = torch.tensor([i.desirable for i in micro], device=policy.device)
            loss, metrics = kto_loss(policy, reference, desirable, z0, beta=p.beta, desirable_weight=p.desirable_weight,
                                     undesirable_weight=p.undesirable_weight, global_seqs=len(items))  # fmt: skip
            if train:
                self.loss_scale.scaled(loss).backward()
            sums["loss"] += loss.item()
            rewards = p.beta * (policy - reference).detach()
            sums["rewards/chosen"] += rewards[desirable].sum().item() / max(good, 1)
            sums["rewards/rejected"] += rewards[~desirable].sum().item() / max(len(items) - good, 1)
            sums["logps/chosen"] += policy[desirable].detach().sum().item() / max(good, 1)
            sums["logps/rejected"] += policy[~desirable].detach().sum().item() / max(len(items) - good, 1)
        sums["rewards/margins"] = sums["rewards/chosen"] - sums["rewards/rejected"]
        sums["kl"] = max(z0, 0.0)
        return sums

    def train_step(self, items: list[Completion]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._pass(items, train=True)
        return self.finish_step(sums, sum(len(i.prompt) + len(i.completion) for i in items))

    def validate(self) -> dict[str, float]:
        return {f"val/{k}": v for k, v in self._pass(self.val_examples, train=False).items()}
