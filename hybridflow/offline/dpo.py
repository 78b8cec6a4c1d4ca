"""DPO and its variants (IPO, hinge, robust; SimPO and ORPO without a reference) on preference
pairs. Chosen and rejected responses of a pair go through one packed forward; the loss divides by
the step's pair count, so micro-batching never changes it. The reference (a frozen copy of the
starting policy) scores every pair once before training by default, then is freed."""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from hybridflow.algorithms.preference import dpo_loss, orpo_loss, simpo_loss
from hybridflow.api.offline import DPOConfig
from hybridflow.batch import plan_microbatches
from hybridflow.offline.base import OfflineTrainer
from hybridflow.offline.preference_data import Pair, load_pairs

REFERENCE_FREE = ("simpo", "orpo")


class DPOTrainer(OfflineTrainer):
    name = "dpo"
    TRL_CONFIG = DPOConfig
    batch_setting = "preference.batch_size"

    def setup(self) -> None:
        """The reference is the starting policy (a checkpoint is loaded after this)."""
        p = self.config.preference
        self.reference = None
        if p.loss_type not in REFERENCE_FREE:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            if p.precompute_ref_logprobs:
                with torch.no_grad():
                    for pairs in (self.train_examples, self.val_examples):
                        for micro in self._microbatches(pairs):
                            chosen, rejected, _, _ = self._sequence_logps(self.reference, micro)
                            for pair, c, r in zip(micro, chosen.tolist(), rejected.tolist()):
                                pair.ref_chosen, pair.ref_rejected = c, r
                self.reference = None  # cached: the copy's memory goes back

    def load(self, files: list[str]) -> list[Pair]:
        return load_pairs(files, self.tokenizer, self.config)

    def _microbatches(self, pairs: list[Pair]) -> list[list[Pair]]:
        a = self.config.actor
        lengths = [2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs]
        return [
            [pairs[i] for i in rows] for rows in plan_microbatches(lengths, a.max_tokens_per_microbatch, None)
        ]

    def _sequence_logps(self, model, pairs: list[Pair]):
        """Summed log-probs of the chosen and rejected responses [b] each, and their lengths [b]."""
        logp = self.response_logprobs(
            model, [p.prompt for p in pairs] * 2, [p.chosen for p in pairs] + [p.rejected for p in pairs]
        )
        sums = logp.sum(-1)  # zero past each response's end
        b = len(pairs)
        lengths = torch.tensor(
            [len(p.chosen) for p in pairs] + [len(p.rejected) for p in pairs], device=sums.device
        )
        return sums[:b], sums[b:], lengths[:b], lengths[b:]

    def _reference(self, pairs: list[Pair]) -> tuple[torch.Tensor, torch.Tensor]:
        if pairs[0].ref_chosen is not None:
            return (torch.tensor([p.ref_chosen for p in pairs], device=self.device),
                    torch.tensor([p.ref_rejected for p in pairs], device=self.device))  # fmt: skip
        with torch.no_grad():
            chosen, rejected, _, _ = self._sequence_logps(self.reference, pairs)
        return chosen, rejected

    def _loss(self, pairs: list[Pair], count: int):
        p = self.config.preference
        chosen, rejected, len_c, len_r = self._sequence_logps(self.model, pairs)
        if p.loss_type == "simpo":
            loss, metrics = simpo_loss(chosen / len_c, rejected / len_r, beta=p.beta, gamma=p.simpo_gamma,
                                       label_smoothing=p.label_smoothing, global_seqs=count)  # fmt: skip
        elif p.loss_type == "orpo":
            loss, metrics = orpo_loss(
                chosen / len_c, rejected / len_r, -chosen / len_c, beta=p.beta, global_seqs=count
            )
        else:
            ref_c, ref_r = self._reference(pairs)
            if p.loss_type == "ipo":  # IPO compares length-averaged log-probs (Azar et al.)
                chosen, rejected, ref_c, ref_r = (
                    chosen / len_c,
                    rejected / len_r,
                    ref_c / len_c,
                    ref_r / len_r,
                )
            loss, metrics = dpo_loss(chosen, rejected, ref_c, ref_r, beta=p.beta, label_smoothing=p.label_smoothing,
                                     kind=p.loss_type, global_seqs=count)  # fmt: skip
        if p.rpo_alpha and p.loss_type != "orpo":  # ORPO's loss already holds the chosen NLL
            nll = -chosen / len_c if p.loss_type != "ipo" else -chosen  # [b] token-mean NLL of each chosen
            loss = loss + p.rpo_alpha * nll.sum() / count
            metrics["nll_loss"] = nll.detach().mean()
        metrics = {k: v.item() for k, v in metrics.items()}
        metrics["logps/chosen"], metrics["logps/rejected"] = chosen.mean().item(), rejected.mean().item()
        return loss, metrics

    def _pass(self, pairs: list[Pair], *, train: bool) -> dict[str, float]:
        """Loss (backward when training) over micro-batches; metrics averaged over the pairs."""
        sums: dict[str, float] = defaultdict(float)
        for micro in self._microbatches(pairs):
            loss, metrics = self._loss(micro, len(pairs))
            if train:
                self.loss_scale.scaled(loss).backward()
            sums["loss"] += loss.item()
            for k, v in metrics.items():
                sums[k] += v * len(micro) / len(pairs)
        return sums

    def train_step(self, pairs: list[Pair]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums = self._pass(pairs, train=True)
        return self.finish_step(sums, sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs))

    def validate(self) -> dict[str, float]:
        return {f"val/{k}": v for k, v in self._pass(self.val_examples, train=False).items()}
