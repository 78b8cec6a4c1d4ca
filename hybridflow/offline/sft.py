"""Supervised fine-tuning on the RL stack's model code and checkpoint format: examples packed into
micro-batches by token budget (no attention across examples), the loss the summed negative
log-likelihood of the target tokens over the step's global target count, checkpoints with
`actor_state/` and a transformers `policy/` that `hybridflow train model.path=...` starts from."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hybridflow.batch import pad_ragged, plan_microbatches
from hybridflow.checkpoint import (
    latest_checkpoint,
    load_checkpoint_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from hybridflow.config import Config, to_yaml
from hybridflow.controller.role_models import policy_model
from hybridflow.controller.run_dir import check_run_dir, clear_run_dir
from hybridflow.data.sampler import PromptSampler
from hybridflow.devices import resolve_device
from hybridflow.models import load_causal_lm, native, save_hf
from hybridflow.offline.sft_data import Example, load_examples
from hybridflow.parallel.checkpoint import load_sharded, save_sharded
from hybridflow.roles.actor import build_optimizer, optimizer_step
from hybridflow.roles.forward import policy_logprobs
from hybridflow.tracking.progress import bar
from hybridflow.tracking.sinks import make_sinks, truncate_jsonl


class SFTTrainer:
    """`SFTTrainer(config).fit()`; the data, optimizer and run settings come from the same config as
    RL (data.*, actor.optim, actor.max_tokens_per_microbatch, trainer.*) plus `sft.*`."""

    def __init__(self, config: Config, *, overwrite: bool = False) -> None:
        c = self.config = config
        self.run_dir = Path(c.trainer.run_dir)
        check_run_dir(self.run_dir, resume=c.trainer.resume, overwrite=overwrite)
        if overwrite:
            clear_run_dir(self.run_dir)
        torch.manual_seed(c.trainer.seed)
        self.device = resolve_device(c.resources.device)
        hf_model, self.tokenizer = load_causal_lm(
            c.model.path, dtype=c.model.dtype, cache_dir=c.model.cache_dir
        )
        self.hf_config = hf_model.config
        self.model = policy_model(c, hf_model.to(self.device))
        if c.model.enable_gradient_checkpointing:
            if isinstance(self.model, native.NativeModule):
                self.model.gradient_checkpointing = True
            else:
                self.model.gradient_checkpointing_enable()
        if c.data.task and not c.data.train_files:
            from hybridflow.data.tasks import cached_task
            from hybridflow.models.default import cache_root

            files = cached_task(c.data.task, dict(c.data.task_options), cache_root(c.model.cache_dir))
            c.data.train_files, c.data.val_files = (
                [str(files["train"])],
                c.data.val_files or [str(files["test"])],
            )
        self.train_examples = load_examples(c.data.train_files, self.tokenizer, c)
        self.val_examples = load_examples(c.data.val_files, self.tokenizer, c) if c.data.val_files else []
        self.sampler = PromptSampler(
            self.train_examples, c.sft.batch_size, seed=c.trainer.seed, shuffle=c.data.shuffle
        )
        self.total_steps = (
            c.trainer.total_training_steps or c.trainer.total_epochs * self.sampler.steps_per_epoch
        )
        self.optimizer, self.scheduler = build_optimizer(self.model, c.actor.optim, self.total_steps)
        self.step = 0
        self._resume()
        self.sinks = make_sinks(c.trainer.logger, self.run_dir, c)

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self) -> dict[str, float]:
        c = self.config
        print(
            f"sft: {len(self.train_examples)} examples, {c.sft.batch_size} per step, {self.total_steps} steps, "
            f"micro-batch budget {c.actor.max_tokens_per_microbatch} tokens",
            flush=True,
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(to_yaml(c), encoding="utf-8")  # for the report
        metrics: dict[str, float] = {}
        if self.step == 0 and self.val_examples and c.trainer.val_before_train:
            self._log(self.validate(), 0)
        progress = bar(self.total_steps, "steps", enabled=c.trainer.progress, initial=self.step)
        try:
            self._loop(metrics, progress)
        finally:
            progress.close()
            if "jsonl" in c.trainer.logger:
                from hybridflow.report import write_report

                print(f"report: {write_report([self.run_dir])}", flush=True)
        for sink in self.sinks:
            sink.close()
        return metrics

    def _loop(self, metrics: dict[str, float], progress) -> None:
        c = self.config
        while self.step < self.total_steps:
            self.step += 1
            metrics.clear()
            metrics |= self.train_step(self.sampler.next())
            last = self.step == self.total_steps
            if self.val_examples and (
                last or (c.trainer.test_freq > 0 and self.step % c.trainer.test_freq == 0)
            ):
                metrics |= self.validate()
            if last or (c.trainer.save_freq > 0 and self.step % c.trainer.save_freq == 0):
                start = time.perf_counter()
                self.save()
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
            self._log(metrics, self.step)
            progress.update()

    def _nll(self, examples: list[Example]) -> tuple[torch.Tensor, int]:
        """Summed negative log-likelihood of the examples' target tokens (one packed forward), and
        how many targets there are. The head runs from each example's first target on."""
        firsts = [e.loss_mask.index(1) for e in examples]
        prompts = [e.token_ids[:f] for e, f in zip(examples, firsts)]
        targets = [e.token_ids[f:] for e, f in zip(examples, firsts)]
        logp, _ = policy_logprobs(
            self.model, prompts, targets, device=self.device, compute_dtype=self.config.actor.compute_dtype,
            pad_token_id=self.tokenizer.pad_token_id,
        )  # fmt: skip
        mask = pad_ragged([e.loss_mask[f:] for e, f in zip(examples, firsts)], logp.shape[1]).to(logp.device)
        return -(logp * mask).sum(), int(mask.sum().item())

    def _microbatches(self, examples: list[Example]) -> list[list[Example]]:
        a = self.config.actor
        plan = plan_microbatches(
            [len(e.token_ids) for e in examples], a.max_tokens_per_microbatch, a.sequences_per_microbatch
        )
        return [[examples[i] for i in rows] for rows in plan]

    def train_step(self, examples: list[Example]) -> dict[str, float]:
        start = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        targets = sum(sum(e.loss_mask) for e in examples)  # the step's global target count
        total = 0.0
        for micro in self._microbatches(examples):
            nll, _ = self._nll(micro)
            (nll / targets).backward()
            total += nll.item()
        done = optimizer_step(
            self.model, self.optimizer, self.scheduler, self.config.actor.optim.grad_clip, {}
        )
        seconds = time.perf_counter() - start
        tokens = sum(len(e.token_ids) for e in examples)
        return {
            "train/loss": total / targets,
            "train/grad_norm": done["grad_norm"] if done else float("nan"),
            "train/lr": self.scheduler.get_last_lr()[0],
            "train/target_tokens": float(targets),
            "train/skipped_updates": float(done is None),
            "timing_s/step": seconds,
            "perf/throughput": tokens / seconds,
        }

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        self.model.eval()
        nll, targets = 0.0, 0
        for micro in self._microbatches(self.val_examples):
            n, t = self._nll(micro)
            nll, targets = nll + n.item(), targets + t
        return {"val/loss": nll / max(targets, 1)}

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path:
        def write_models(directory: Path) -> None:
            save_sharded(self.model, self.optimizer, directory / "actor_state")
            export = (
                native.to_hf_model(self.model, self.hf_config)
                if isinstance(self.model, native.NativeModule)
                else self.model
            )
            save_hf(export, self.tokenizer, directory / "policy")

        return save_checkpoint(
            self.run_dir,
            self.step,
            write_models=write_models,
            optim_state={"actor_scheduler": self.scheduler.state_dict()},
            trainer_state={"step": self.step, "sampler": self.sampler.state_dict(), "rng": rng_state()},
            config_yaml=to_yaml(self.config),
            keep_last=self.config.trainer.keep_last_checkpoints,
        )

    def _resume(self) -> None:
        path = latest_checkpoint(self.run_dir) if self.config.trainer.resume == "auto" else None
        if path is None:
            truncate_jsonl(self.run_dir / "metrics.jsonl", 0)
            return
        state, schedulers = load_checkpoint_state(path)
        load_sharded(self.model, self.optimizer, path / "actor_state")
        self.scheduler.load_state_dict(schedulers["actor_scheduler"])
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)
        print(f"resumed from {path} (step {self.step})", flush=True)
