"""The Actor role: the policy being trained — log-probs of sequences and PPO-style updates."""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import torch

from hybridflow.algorithms.aggregation import aggregate, count_sequences, count_tokens
from hybridflow.algorithms.kl import kl_penalty
from hybridflow.algorithms.policy_losses import policy_loss
from hybridflow.batch import GapScope, TrainingBatch
from hybridflow.config.schema import ActorConfig, OptimConfig
from hybridflow.devices import to_device
from hybridflow.errors import UserError
from hybridflow.models.native.moe import SparseMoE, load_balancing_loss
from hybridflow.parallel.collectives import (
    clip_grad_norm,
    data_parallel_scale,
    max_values_over_ranks,
    sum_over_ranks,
)
from hybridflow.parallel.expert import reduce_expert_gradients
from hybridflow.roles.forward import in_step_microbatches, microbatches, policy_logprobs, shares_prompts
from hybridflow.roles.loss_scale import GradientOverflow, LossScale
from hybridflow.tracking.progress import bar


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    return optim.warmup_steps if optim.warmup_steps > 0 else int(optim.warmup_ratio * total_steps)


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, total_steps: int):
    """AdamW (fused on CUDA) and a warmup + constant/cosine schedule over `total_steps` training steps.
    The schedule moves once per training step (`scheduler.step()` after a step's updates, as verl's),
    not once per mini-batch: warmup and cosine lengths are in the same unit as total_training_steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.is_cuda for p in params)
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay, fused=fused or None
    )

    warmup = warmup_steps(optim, total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if optim.lr_scheduler == "linear":
            return 1.0 - (1 - optim.min_lr_ratio) * progress
        return optim.min_lr_ratio + (1 - optim.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def optimizer_step(
    model, optimizer, grad_clip: float, sums: dict[str, float], loss_scale: LossScale | None = None
) -> dict[str, float] | None:
    """After a mini-batch's backward passes: metric sums over ranks (each rank holds its share, so
    the sums are the global values), gradients unscaled (float16's loss scale), clipped to the global
    gradient norm, and the step; None (no step, the gradients dropped) when the norm is not finite,
    which every rank sees alike. Raises GradientOverflow when the loss scale was to blame (halved:
    the caller runs the mini-batch again)."""
    keys = sorted(sums)
    sums = dict(zip(keys, sum_over_ranks([sums[k] for k in keys])))
    reduce_expert_gradients(model)  # with several expert-parallel groups: summed across them
    if loss_scale is not None:
        loss_scale.unscale(model.parameters())
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        if loss_scale is not None and loss_scale.overflowed():
            raise GradientOverflow
        return None
    optimizer.step()
    if loss_scale is not None:
        loss_scale.stepped()
    sums["grad_norm"] = grad_norm.item()
    return sums


def with_loss_scale_retries(update, minibatch):
    """`update(minibatch)`, again at each halved loss scale until its gradients are finite."""
    while True:
        try:
            return update(minibatch)
        except GradientOverflow:
            continue


def _measures_gap(mb: TrainingBatch) -> bool:
    """Whether the update's forward measures the rollout/trainer gap of this mini-batch: pi_old is
    not recomputed (the on-policy shortcut) or is the sampler's (gap_scopes set)."""
    return mb.rollout_logprobs is not None and (mb.old_logprobs is None or mb.gap_scopes is not None)


def _on_host(sums: dict) -> dict[str, float]:
    """Metric sums, some of them 0-d device tensors, as floats: one transfer for all."""
    keys = [k for k, v in sums.items() if isinstance(v, torch.Tensor)]
    values = torch.stack([sums[k].double() for k in keys]).tolist() if keys else []
    return {k: float(v) for k, v in sums.items() if not isinstance(v, torch.Tensor)} | dict(zip(keys, values))


def _lengths(batch: TrainingBatch) -> list[int]:
    return [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]


class Actor:
    """Policy model + optimizer. `update` runs ppo_epochs over mini-batches of `sequences_per_update`,
    each split into micro-batches by token budget with gradient accumulation; the loss divides by the
    mini-batch's global token/sequence counts, so the split never changes the gradient."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ActorConfig,
        *,
        total_steps: int,
        max_response_tokens: int,
        pad_token_id: int,
        gradient_checkpointing: bool = False,
        device: torch.device | None = None,
        progress: bool = False,
        temperature: float = 1.0,
    ) -> None:
        """`progress`: a transient bar of micro-batches during an update (on a terminal only).
        `temperature`: the rollout's; the policy is softmax(logits / temperature), as in verl, so the
        trainer's log-probs equal the rollout's."""
        self.model = model
        self.temperature = temperature
        self.config = config
        # an MoE policy's expert blocks record their routing when the load-balancing loss is trained
        self.moe_blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
        if config.router_aux_loss_coef and not self.moe_blocks:  # never a setting silently unused
            raise UserError(
                f"actor.router_aux_loss_coef={config.router_aux_loss_coef:g} trains mixture-of-experts routers, "
                "and this policy has none in our model (a Qwen3-MoE or Mixtral model with model.impl=native "
                "has them); set it to 0"
            )
        for block in self.moe_blocks:
            block.record_routing = bool(config.router_aux_loss_coef)
        if config.router_replay != "disabled" and not self.moe_blocks:
            raise UserError(
                f"actor.router_replay={config.router_replay} replays a mixture-of-experts policy's routing, and "
                "this policy has no experts in our model (a Qwen3-MoE or Mixtral model with model.impl=native "
                "has them); set actor.router_replay=disabled"
            )
        # the compute device: parameters offloaded to the CPU (FSDP2) still run there
        self.device = device or next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.max_response_tokens = max_response_tokens
        if gradient_checkpointing:
            if hasattr(model, "gradient_checkpointing_enable"):
                model.gradient_checkpointing_enable()
            else:  # the native model checkpoints each layer
                model.gradient_checkpointing = True
        self.optimizer, self.scheduler = build_optimizer(model, config.optim, total_steps)
        self.loss_scale = LossScale(config.compute_dtype)
        self.progress = progress

    def _forward(self, batch: TrainingBatch, *, with_entropy: bool, entropy_grad: bool = False):
        routes = None
        if self.config.router_replay != "disabled":  # recorded experts (a row without any routes freely)
            routes = batch.routed_experts or [None] * len(batch)
        return policy_logprobs(
            self.model, batch.prompt_ids, batch.response_ids, device=self.device,
            compute_dtype=self.config.compute_dtype, pad_token_id=self.pad_token_id,
            with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=self.temperature,
            routes=routes,
        )  # fmt: skip

    def _grouping(self, batch: TrainingBatch) -> list[list[int]] | None:
        """Prompts by which micro-batches keep a group together (a model that packs a prompt once;
        replayed routes pack each sequence whole)."""
        replay = self.config.router_replay != "disabled"
        return batch.prompt_ids if shares_prompts(self.model) and not replay else None

    @torch.no_grad()
    def log_probs(
        self, batch: TrainingBatch, *, with_entropy: bool = False, routes: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-prob [B, T] of every response token under the current policy (and entropy [B, T]).
        `routes`, a list of len(batch): filled with each sequence's experts per MoE layer as this
        pass routed them, [L - 1, MoE layers, k] int16 (router replay R2)."""
        self.model.eval()
        width = batch.response_mask.shape[1]
        logps = torch.zeros(len(batch), width)
        entropy = torch.zeros(len(batch), width) if with_entropy else None
        lengths = [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        recording = routes is not None
        for block in self.moe_blocks if recording else ():
            block.record_routing = True
        for rows, padding in in_step_microbatches(
            lengths, self.config.max_tokens_per_microbatch, self.config.sequences_per_microbatch,
            prompt_ids=self._grouping(batch),
        ):  # fmt: skip
            lp, ent = self._forward(batch.select(rows), with_entropy=with_entropy)
            if padding:
                continue
            logps[rows, : lp.shape[1]] = lp.float().cpu()
            if with_entropy:
                entropy[rows, : ent.shape[1]] = ent.float().cpu()
            if recording:  # sequences packed whole, in order (_grouping): split the tokens back
                chosen = torch.stack(
                    [block.routing.experts for block in self.moe_blocks], dim=1
                )  # [N, L_moe, k]
                for i, kept in zip(rows, chosen.split([lengths[i] for i in rows])):
                    routes[i] = kept[:-1].to(torch.int16).cpu()  # the last token routes freely (as R3's)
        for block in self.moe_blocks if recording else ():
            block.record_routing = bool(self.config.router_aux_loss_coef)
            block.routing = None
        return logps * batch.response_mask, entropy

    def update(self, batch: TrainingBatch) -> dict[str, float]:
        """PPO epochs over mini-batches of `sequences_per_update` sequences; metrics (actor/*)."""
        return self.update_minibatches(batch.minibatches(self.config.sequences_per_update))

    def update_minibatches(self, minibatches: list[TrainingBatch]) -> dict[str, float]:
        """PPO epochs over the given mini-batches (under data parallelism: this rank's share of each
        global mini-batch); returns averaged metrics (actor/*), the same on every rank. With the
        on-policy shortcut (no old log-probs), or pi_old taken from the sampler (mini-batches with
        gap_scopes), it also reports the rollout-vs-trainer probability gap
        (training/rollout_probs_diff*_*), measured by the forwards before the first optimizer step:
        the first mini-batch's tokens where there are several."""
        sums: dict[str, float] = defaultdict(float)
        updates = skipped = 0
        self._rollout_gaps: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gaps, scopes) per micro-batch
        self.model.train()
        cfg = self.config
        self._bar = bar(None, "update", enabled=self.progress, inner=True)
        if not self._bar.disable:  # the micro-batch count is planned again only for a bar drawn
            plans = (microbatches(_lengths(mb), cfg.max_tokens_per_microbatch, cfg.sequences_per_microbatch,
                                        prompt_ids=self._grouping(mb))
                     for mb in minibatches)  # fmt: skip
            self._bar.total = cfg.ppo_epochs * sum(len(plan) for plan in plans)
        first_kl = None  # the step's first mini-batch, before any update: ppo_kl ~0 (a guard's check)
        for epoch in range(self.config.ppo_epochs):
            for i, mb in enumerate(minibatches):
                before_any_update = epoch == 0 and i == 0
                metrics = with_loss_scale_retries(
                    functools.partial(self._update_minibatch, first=before_any_update), mb
                )
                if first_kl is None and mb.old_logprobs is not None:
                    first_kl = float("nan") if metrics is None else metrics.get("ppo_kl", 0.0)
                if metrics is None:
                    skipped += 1
                    continue
                updates += 1
                for k, v in metrics.items():
                    sums[k] += v
        self._bar.close()
        self.model.eval()
        out = {f"actor/{k}": v / max(updates, 1) for k, v in sums.items()}
        out["actor/lr"] = self.scheduler.get_last_lr()[0]  # the step's rate; the next step's after
        self.scheduler.step()
        out["actor/skipped_updates"] = float(skipped)
        if first_kl is not None and first_kl == first_kl:  # not NaN: a skipped update says nothing
            out["training/first_minibatch_ppo_kl"] = first_kl
        if any(_measures_gap(mb) for mb in minibatches):
            out |= self._rollout_gap_metrics()
        return out

    def _rollout_gap_metrics(self) -> dict[str, float]:
        """Max, mean and std of |p_rollout - p_trainer| over every rank's response tokens counted,
        and over each narrower GapScope (_fresh, _kept_kv) that has tokens on some rank."""
        values = scopes = torch.zeros(0)
        if self._rollout_gaps:
            values, scopes = (torch.cat(parts).cpu() for parts in zip(*self._rollout_gaps))
        picks = [scopes > 0, scopes == GapScope.FRESH, scopes == GapScope.KEPT_KV]
        gaps = [values[p].double() for p in picks]
        # one reduction for all scopes: every rank calls the same collectives whatever it holds
        sums = sum_over_ranks([x for g in gaps for x in (g.numel(), g.sum().item(), (g**2).sum().item())])
        tops = max_values_over_ranks([g.max().item() if g.numel() else 0.0 for g in gaps])
        out = {}
        for k, suffix in enumerate(("", GapScope.FRESH.suffix, GapScope.KEPT_KV.suffix)):
            count, total, squares = sums[3 * k : 3 * k + 3]
            if not count:
                continue
            mean = total / count
            var = max(squares / count - mean**2, 0.0) * count / max(count - 1, 1)  # unbiased, as torch.std
            out |= {
                f"training/rollout_probs_diff{suffix}_max": tops[k],
                f"training/rollout_probs_diff{suffix}_mean": mean,
                f"training/rollout_probs_diff{suffix}_std": var**0.5,
            }
        return out

    def _update_minibatch(self, mb: TrainingBatch, first: bool = True) -> dict[str, float] | None:
        """One optimizer step over `mb`; `first`: no step has been taken on this batch before it, so
        its forward is the policy that the rollout's probabilities are measured against."""
        cfg = self.config
        mask = mb.response_mask
        # Under data parallelism `mb` is this rank's share: the denominators count the whole mini-batch
        tokens, seqs = (int(x) for x in sum_over_ranks([count_tokens(mask), count_sequences(mask)]))
        lengths = _lengths(mb)
        sums: dict[str, float] = defaultdict(float)
        gaps: list[tuple[torch.Tensor, torch.Tensor]] = []  # the rollout/trainer gaps, per micro-batch
        self.optimizer.zero_grad(set_to_none=True)
        # every rank runs as many micro-batches (FSDP gathers per forward); padding ones count zero
        for rows, padding in in_step_microbatches(
            lengths,
            cfg.max_tokens_per_microbatch,
            cfg.sequences_per_microbatch,
            prompt_ids=self._grouping(mb),
        ):
            micro = mb.select(rows)
            share = count_tokens(micro.response_mask) / max(tokens, 1)  # token share, for metric averages
            logp, entropy = self._forward(micro, with_entropy=True, entropy_grad=bool(cfg.entropy_coeff))
            m = to_device(micro.response_mask, logp.device)
            # on-policy shortcut: the policy before this update is the one computing logp
            old = logp.detach() if micro.old_logprobs is None else to_device(micro.old_logprobs, logp.device)
            if first and _measures_gap(micro) and not padding:
                gap = (
                    logp.detach().exp() - to_device(micro.rollout_logprobs, logp.device).exp()
                ).abs()  # [b, T]
                scopes = m.to(torch.int8) if micro.gap_scopes is None else micro.gap_scopes  # [b, T]
                gaps.append(
                    (gap.float().flatten(), to_device(scopes, logp.device).flatten())
                )  # to the host later
            weights = (
                to_device(micro.importance_weights, logp.device)
                if micro.importance_weights is not None
                else None
            )
            pg_loss, pg_metrics = policy_loss(
                cfg.policy_loss,
                logp,
                old,
                to_device(micro.advantages, logp.device),
                m,
                clip_low=cfg.clip_ratio_low,
                clip_high=cfg.clip_ratio_high,
                clip_c=cfg.clip_ratio_c,
                agg=cfg.loss_agg_mode,
                importance_weights=weights,
                global_tokens=tokens,
                global_seqs=seqs,
                scale=self.max_response_tokens,
            )

            # KL and entropy terms share the policy loss's denominators
            agg = functools.partial(
                aggregate,
                mask=m,
                mode=cfg.loss_agg_mode,
                global_tokens=tokens,
                global_seqs=seqs,
                scale=self.max_response_tokens,
            )
            loss = pg_loss
            entropy_loss = agg(entropy)
            if cfg.entropy_coeff:
                loss = loss - cfg.entropy_coeff * entropy_loss
            if cfg.use_kl_loss:
                kl = kl_penalty(logp, to_device(micro.ref_logprobs, logp.device), cfg.kl_loss_type)
                kl_loss = agg(kl)
                loss = loss + cfg.kl_loss_coef * kl_loss
                sums["kl_loss"] += 0.0 if padding else kl_loss.detach()
            if self.moe_blocks and cfg.router_aux_loss_coef:  # routing recorded by this forward
                aux = self._router_aux_loss()
                loss = loss + cfg.router_aux_loss_coef * aux * share  # the shares sum to 1 over the batch
                sums["moe_aux_loss"] += 0.0 if padding else aux.detach() * share
            if padding:
                (loss * 0.0).backward()
                continue
            # a non-finite loss makes the (global) gradient norm non-finite: every rank skips the step
            self.loss_scale.scaled(loss * data_parallel_scale()).backward()
            self._bar.update()
            # metrics stay on the device until the mini-batch ends: a read per micro-batch would stall
            # the host until the GPU drains, and the GPU then waits for the next micro-batch's launch
            sums["pg_loss"] += pg_loss.detach()
            sums["entropy"] += entropy_loss.detach()
            for k, v in pg_metrics.items():
                sums[k] += v.detach() * share
        stepped = optimizer_step(
            self.model, self.optimizer, cfg.optim.grad_clip, _on_host(sums), self.loss_scale
        )
        self._rollout_gaps += gaps  # not reached by an attempt the loss scale retries
        return stepped

    def _router_aux_loss(self) -> torch.Tensor:
        routings = [block.routing for block in self.moe_blocks]
        first = self.moe_blocks[0]
        return load_balancing_loss(routings, first.num_experts, first.top_k)

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        return state | ({"loss_scale": self.loss_scale.state_dict()} if self.loss_scale.enabled else {})

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "loss_scale" in state and self.loss_scale.enabled:
            self.loss_scale.load_state_dict(state["loss_scale"])
