"""The Critic role: a value model (policy backbone + scalar head per token), for GAE."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import AutoModelForTokenClassification

from hybridflow.algorithms.aggregation import count_sequences, count_tokens
from hybridflow.algorithms.losses import value_loss
from hybridflow.batch import TrainingBatch
from hybridflow.config.schema import CriticConfig
from hybridflow.parallel.collectives import data_parallel_scale, sum_over_ranks
from hybridflow.roles.actor import build_optimizer, optimizer_step, with_loss_scale_retries
from hybridflow.roles.forward import (
    autocast,
    in_step_microbatches,
    packed_inputs,
    response_slices,
    right_padded_inputs,
    unflatten_responses,
)
from hybridflow.roles.loss_scale import LossScale


def value_model_from_policy(policy: torch.nn.Module) -> torch.nn.Module:
    """A value model whose backbone starts as a copy of the policy's and whose head starts at zero
    (initial values are 0): ours (packed) for a native policy, else a one-label transformers
    token-classification model."""
    if hasattr(policy, "hidden_states"):
        from hybridflow.models.native.heads import value_model_from_causal_lm

        return value_model_from_causal_lm(policy)
    config = policy.config.__class__.from_dict(policy.config.to_dict())
    config.num_labels = 1
    critic = AutoModelForTokenClassification.from_config(config, dtype=next(policy.parameters()).dtype)
    critic.base_model.load_state_dict(policy.base_model.state_dict())
    head = critic.score if hasattr(critic, "score") else critic.classifier
    torch.nn.init.zeros_(head.weight)
    if getattr(head, "bias", None) is not None:
        torch.nn.init.zeros_(head.bias)
    return critic.to(next(policy.parameters()).device)


def load_value_model(path: str, device: torch.device, cache_dir: str | None = None) -> torch.nn.Module:
    """A value model from an HF directory or 'default' (a token-classification checkpoint, or a
    causal LM whose backbone is reused under a new zero-initialised one-label head)."""
    from hybridflow.errors import UserError
    from hybridflow.models.loading import resolve_model_path

    directory = resolve_model_path(path, cache_dir)
    if directory.is_file():
        raise UserError(f"critic.model_path={path}: a value model loads from an HF directory, not a file")
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its load report lists the new value head's keys: expected
    try:
        model = AutoModelForTokenClassification.from_pretrained(directory, num_labels=1)
    except (OSError, ValueError) as e:
        raise UserError(
            f"critic.model_path={path}: cannot load a value model ({str(e).splitlines()[0]})"
        ) from e
    finally:
        transformers_logging.set_verbosity(verbosity)
    return model.to(device)


class Critic:
    """V(s_t) at the position that predicts each response token; clipped value-loss updates."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: CriticConfig,
        *,
        total_steps: int,
        compute_dtype: str,
        pad_token_id: int,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.config = config
        # the compute device: parameters offloaded to the CPU (FSDP2) still run there
        self.device = device or next(model.parameters()).device
        self.compute_dtype = compute_dtype
        self.pad_token_id = pad_token_id
        self.optimizer, self.scheduler = build_optimizer(model, config.optim, total_steps)
        self.loss_scale = LossScale(compute_dtype)

    def _values(self, batch: TrainingBatch) -> torch.Tensor:
        if hasattr(self.model, "token_scores"):  # native: packed, no padding
            inputs, index = packed_inputs(batch.prompt_ids, batch.response_ids, self.device)
            with autocast(self.device, self.compute_dtype):
                flat = self.model.token_scores(*inputs)[:, 0].index_select(0, index)  # [R]
            values = unflatten_responses(flat.float(), batch.response_ids)  # [b, T']
            return F.pad(values, (0, batch.response_mask.shape[1] - values.shape[1]))  # [b, T]
        input_ids, attention = right_padded_inputs(
            batch.prompt_ids, batch.response_ids, self.device, self.pad_token_id
        )
        with autocast(self.device, self.compute_dtype):
            out = self.model(input_ids=input_ids, attention_mask=attention).logits[..., 0]  # [b, L]
        return response_slices(out.float(), batch.prompt_ids, batch.response_mask.shape[1])  # [b, T]

    @torch.no_grad()
    def values(self, batch: TrainingBatch) -> torch.Tensor:
        self.model.eval()
        out = torch.zeros_like(batch.response_mask)
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        for rows, padding in in_step_microbatches(lengths, self.config.max_tokens_per_microbatch, None):
            v = self._values(batch.select(rows))
            if not padding:
                out[rows, : v.shape[1]] = v.cpu()
        return out * batch.response_mask

    def update_minibatches(self, minibatches: list[TrainingBatch], *, epochs: int = 1) -> dict[str, float]:
        """Value-loss epochs over the given mini-batches (under data parallelism: this rank's share of
        each global mini-batch, normalised by global counts as the actor does); metrics (critic/*)."""
        sums: dict[str, float] = defaultdict(float)
        updates = 0
        self.model.train()
        for _ in range(epochs):
            for mb in minibatches:
                metrics = with_loss_scale_retries(self._update_minibatch, mb)
                if metrics is not None:
                    updates += 1
                    for k, v in metrics.items():
                        sums[k] += v
        self.model.eval()
        out = {f"critic/{k}": v / max(updates, 1) for k, v in sums.items()}
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        self.scheduler.step()  # once per training step, as the actor's
        return out

    def _update_minibatch(self, mb: TrainingBatch) -> dict[str, float] | None:
        tokens, seqs = (
            int(x)
            for x in sum_over_ranks([count_tokens(mb.response_mask), count_sequences(mb.response_mask)])
        )
        lengths = [len(p) + len(r) for p, r in zip(mb.prompt_ids, mb.response_ids)]
        sums: dict[str, float] = defaultdict(float)
        self.optimizer.zero_grad(set_to_none=True)
        for rows, padding in in_step_microbatches(lengths, self.config.max_tokens_per_microbatch, None):
            micro = mb.select(rows)
            v = self._values(micro)
            loss, metrics = value_loss(
                v,
                micro.old_values.to(v.device),
                micro.returns.to(v.device),
                micro.response_mask.to(v.device),
                clip=self.config.cliprange_value,
                agg=self.config.loss_agg_mode,
                global_tokens=tokens,
                global_seqs=seqs,
            )
            if padding:
                (loss * 0.0).backward()
                continue
            self.loss_scale.scaled(loss * data_parallel_scale()).backward()
            share = count_tokens(micro.response_mask) / max(tokens, 1)
            sums["vf_loss"] += loss.item()
            sums["vf_clipfrac"] += metrics["vf_clipfrac"].item() * share
            sums["vpred_mean"] += (v.detach().cpu() * micro.response_mask).sum().item() / max(tokens, 1)
        return optimizer_step(self.model, self.optimizer, self.config.optim.grad_clip, sums, self.loss_scale)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
