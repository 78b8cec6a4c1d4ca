"""Supervised fine-tuning: examples packed into micro-batches by token budget (no attention across
examples), the loss the summed negative log-likelihood of the target tokens over the step's global
target count. Checkpoints have the RL trainer's layout: `hybridflow train model.path=.../policy`
starts from one as it is."""

from __future__ import annotations

import torch

from hybridflow.api.offline import SFTConfig
from hybridflow.batch import pad_ragged, plan_microbatches
from hybridflow.offline.base import OfflineTrainer
from hybridflow.offline.sft_data import Example, load_examples


class SFTTrainer(OfflineTrainer):
    """`SFTTrainer(config).fit()`; data, optimizer and run settings come from the same config as RL
    (data.*, actor.optim, actor.max_tokens_per_microbatch, trainer.*) plus `sft.*`."""

    name = "sft"
    TRL_CONFIG = SFTConfig
    batch_setting = "sft.batch_size"

    def load(self, files: list[str]) -> list[Example]:
        return load_examples(files, self.tokenizer, self.config)

    def _nll(self, examples: list[Example]) -> tuple[torch.Tensor, int]:
        """Summed negative log-likelihood of the examples' target tokens (one packed forward), and
        how many targets there are. The head runs from each example's first target on."""
        firsts = [e.loss_mask.index(1) for e in examples]
        logp = self.response_logprobs(
            self.model,
            [e.token_ids[:f] for e, f in zip(examples, firsts)],
            [e.token_ids[f:] for e, f in zip(examples, firsts)],
        )  # [b, T]
        mask = pad_ragged([e.loss_mask[f:] for e, f in zip(examples, firsts)], logp.shape[1]).to(logp.device)
        return -(logp * mask).sum(), int(mask.sum().item())

    def _microbatches(self, examples: list[Example]) -> list[list[Example]]:
        a = self.config.actor
        lengths = [len(e.token_ids) for e in examples]
        return [
            [examples[i] for i in rows]
            for rows in plan_microbatches(lengths, a.max_tokens_per_microbatch, a.sequences_per_microbatch)
        ]

    def train_step(self, examples: list[Example]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        targets = sum(sum(e.loss_mask) for e in examples)  # the step's global target count
        total = 0.0
        for micro in self._microbatches(examples):
            nll, _ = self._nll(micro)
            self.loss_scale.scaled(nll / targets).backward()
            total += nll.item()
        tokens = sum(len(e.token_ids) for e in examples)
        return self.finish_step({"loss": total / targets, "train/target_tokens": float(targets)}, tokens)

    def validate(self) -> dict[str, float]:
        nll, targets = 0.0, 0
        for micro in self._microbatches(self.val_examples):
            n, t = self._nll(micro)
            nll, targets = nll + n.item(), targets + t
        return {"val/loss": nll / max(targets, 1)}
