"""What the offline trainers share: the run directory, the policy (our packed model where the family
is supported), a seeded resumable example order, AdamW with the RL schedule, the step loop with
validation, checkpoints in the RL trainer's layout (`actor_state/` + a transformers `policy/`), exact
resume, sinks and the report. A trainer supplies its examples, `train_step` and `validate`."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from hybridflow import run_manifest
from hybridflow.checkpoint import (
    check_resumable,
    latest_checkpoint,
    load_checkpoint_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from hybridflow.config import Config, to_yaml
from hybridflow.config.sections_run import due
from hybridflow.controller.graceful_stop import GracefulStop, stop_with_checkpoint
from hybridflow.controller.policy_export import export_policy
from hybridflow.controller.role_models import lora_policy, policy_model
from hybridflow.controller.run_dir import prepare_run_dir
from hybridflow.data.sampler import PromptSampler
from hybridflow.data.tasks import use_task_files
from hybridflow.devices import follow_free_cores, resolve_device, seed_process
from hybridflow.disk_full import disk_full_error
from hybridflow.errors import UserError
from hybridflow.models import native
from hybridflow.models.loading import load_model
from hybridflow.parallel.checkpoint import load_sharded, save_sharded
from hybridflow.roles.actor import build_optimizer, optimizer_step, with_loss_scale_retries
from hybridflow.roles.forward import policy_logprobs
from hybridflow.roles.loss_scale import LossScale
from hybridflow.tracking.progress import bar
from hybridflow.tracking.sinks import jsonl_row, make_sinks, restore_last_row, truncate_jsonl

# TRL Trainer arguments with no counterpart here, each with what to do instead
THEIR_ARGUMENTS = {
    "callbacks": "transformers' TrainerCallback hooks run inside transformers' Trainer loop, which this "
    "trainer does not use: read RUN_DIR/metrics.jsonl, or call train() with trainer.total_training_steps in a loop",
    "data_collator": "examples are packed by this trainer (sft.max_tokens, actor.max_tokens_per_microbatch)",
    "compute_metrics": "validation reports the loss (val/loss) on eval_dataset",
    "optimizers": "AdamW with args' learning_rate, weight_decay and lr_scheduler_type",
    "formatting_func": "format the rows first (a list of dicts or datasets.Dataset.map)",
    "ref_model": "the reference is the starting policy",
}


def refuse_their_arguments(name: str, given: dict[str, Any]) -> None:
    unknown = {k: v for k, v in given.items() if v not in (None, [], (), (None, None))}
    if unknown:
        parts = [f"{k}: {THEIR_ARGUMENTS.get(k, 'not an argument of this trainer')}" for k in unknown]
        raise UserError(f"{name} does not take " + "; ".join(parts))


def _dig(config: Config, key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def refuse_unsupported(c: Config, command: str) -> None:
    """The offline trainers run one process on one device: a setting they would not honour stops the
    run at once, naming it, rather than being ignored."""
    ignored = {
        "model.compile": c.model.compile,
        "actor.offload_params": c.actor.offload_params,
        "actor.offload_optimizer": c.actor.offload_optimizer,
        "actor.sequence_parallel_size": c.actor.sequence_parallel_size
        if c.actor.sequence_parallel_size > 1
        else 0,
        "resources.num_workers": c.resources.num_workers if c.resources.num_workers > 1 else 0,
        "resources.n_gpus_per_node": c.resources.n_gpus_per_node if c.resources.n_gpus_per_node > 1 else 0,
        "resources.nnodes": c.resources.nnodes if c.resources.nnodes > 1 else 0,
    }
    named = [f"{k}={v}" for k, v in ignored.items() if v]
    if named:
        raise UserError(
            f"hybridflow {command} trains in one process on one device; it does not do "
            f"{', '.join(named)}: remove {'it' if len(named) == 1 else 'them'} (the RL trainer does)"
        )


class OfflineTrainer:
    name = "offline"
    batch_setting = ""
    """The setting that holds `batch_size` (named when it does not fit the data)."""

    TRL_CONFIG: type | None = None
    """The config class with TRL's names for this trainer (api/offline.py)."""

    def __init__(
        self,
        config: Config | Any = None,
        *,
        overwrite: bool = False,
        model: Any = None,
        args: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        **theirs: Any,
    ) -> None:
        """`Trainer(config)` (a resolved Config), or TRL's way: `Trainer(model, args=XConfig(...),
        train_dataset=..., eval_dataset=..., processing_class=..., peft_config=...)` with live objects
        or paths (written under the run's inputs/), then `train()` and `save_model(dir)`."""
        writes: list = []
        if not isinstance(config, Config) or any(
            v is not None for v in (model, args, train_dataset, eval_dataset, processing_class, peft_config)
        ):
            from hybridflow.api.offline import trl_offline_config

            refuse_their_arguments(type(self).__name__, theirs)
            if isinstance(config, Config):
                raise UserError(f"{type(self).__name__}: give a Config, or TRL's model=/args=..., not both")
            config, writes, notes = trl_offline_config(
                self.TRL_CONFIG, model=model if model is not None else config, args=args,
                train_dataset=train_dataset, eval_dataset=eval_dataset,
                processing_class=processing_class, peft_config=peft_config,
            )  # fmt: skip
            for note in notes:
                print(f"note: {note}", flush=True)
        elif theirs:
            refuse_their_arguments(type(self).__name__, theirs)
        c = self.config = config
        batch_size = _dig(c, self.batch_setting)
        refuse_unsupported(c, self.name)
        self.run_dir, self.run_lock = prepare_run_dir(c, overwrite=overwrite)
        for target, write in writes:  # the live inputs, once the directory is this run's
            run_manifest.record(self.run_dir, target)
            write()
        seed_process(c.trainer.seed, deterministic=c.deterministic_processes)
        self.device = resolve_device(c.resources.device)
        hf_model, self.tokenizer = load_model(c.model)
        self.hf_config = hf_model.config
        # LoRA as in the RL trainer: adapters on the frozen policy; exports merge them
        self.model = lora_policy(c, policy_model(c, hf_model).to(self.device))
        if c.model.enable_gradient_checkpointing:
            if isinstance(self.model, native.NativeModule):
                self.model.gradient_checkpointing = True
            else:
                self.model.gradient_checkpointing_enable()
        use_task_files(c)
        self.train_examples = self.load(c.data.train_files)
        self.val_examples = self.load(c.data.val_files) if c.data.val_files else []
        self.sampler = PromptSampler(
            self.train_examples, batch_size, seed=c.trainer.seed, shuffle=c.data.shuffle,
            setting=self.batch_setting, what="examples",
        )  # fmt: skip
        self.total_steps = (
            c.trainer.total_training_steps or c.trainer.total_epochs * self.sampler.steps_per_epoch
        )
        self.optimizer, self.scheduler = build_optimizer(self.model, c.actor.optim, self.total_steps)
        self.loss_scale = LossScale(c.actor.compute_dtype)  # float16's; 1 otherwise
        self.step = 0
        self.last_checkpoint: Path | None = None
        self.setup()
        self._resume()
        self.sinks = make_sinks(c.trainer.logger, self.run_dir, c)

    # ---- what a trainer supplies ----------------------------------------------------------------
    def setup(self) -> None:
        """Runs before a checkpoint is loaded: the model is still the starting policy here."""

    def load(self, files: list[str]) -> list:
        raise NotImplementedError

    def train_step(self, examples: list) -> dict[str, float]:
        raise NotImplementedError

    def validate(self) -> dict[str, float]:
        raise NotImplementedError

    # ---- shared ---------------------------------------------------------------------------------
    def response_logprobs(self, model, prompts: list[list[int]], responses: list[list[int]]) -> torch.Tensor:
        """Log-prob [b, T] of each response token after its prompt (zero past a response's end)."""
        logp, _ = policy_logprobs(
            model, prompts, responses, device=self.device, compute_dtype=self.config.actor.compute_dtype,
            pad_token_id=self.tokenizer.pad_token_id,
        )  # fmt: skip
        return logp

    def fit(self) -> dict[str, float]:
        c = self.config
        print(
            f"{self.name}: {len(self.train_examples)} examples, {self.sampler.prompts_per_step} per step, "
            f"{self.total_steps} steps, micro-batch budget {c.actor.max_tokens_per_microbatch} tokens",
            flush=True,
        )
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_manifest.write_text_atomic(self.run_dir / "config.yaml", to_yaml(c))  # for the report
        metrics: dict[str, float] = {}
        if self.step == 0 and self.val_examples and c.trainer.val_before_train:
            self._log(self.validate(), 0)
        progress = bar(self.total_steps, "steps", enabled=c.trainer.progress, initial=self.step)
        try:
            # SIGTERM / Ctrl-C: finish the step, save, return (a second: at once)
            with GracefulStop() as stop:
                while self.step < self.total_steps and not stop.requested:
                    self.step += 1
                    metrics = self._step()
                    progress.update()
                if stop.requested:
                    stop_with_checkpoint(self, stop.requested, saves=True)
        except Exception as e:
            if (full := disk_full_error(e, self.run_dir, self.last_checkpoint)) is not None:
                raise full from e
            raise
        finally:
            progress.close()
            try:
                from hybridflow.report import write_report

                print(f"report: {write_report([self.run_dir])}", flush=True)
            except Exception as e:  # a report must never hide how the run ended (a full disk, ...)
                print(f"report not written ({type(e).__name__}: {e})", flush=True)
        for sink in self.sinks:
            sink.close()
        self.run_lock.release()  # the directory is free for the next run
        return metrics

    def train(self) -> dict[str, float]:
        """TRL's name for `fit`."""
        return self.fit()

    def save_model(self, output_dir: str | Path, *, overwrite: bool = False) -> Path:
        """The current policy as a transformers directory (TRL's save_model), checked by a reload."""
        from hybridflow.models.checkpoint_export import export_checkpoint

        latest = self.last_checkpoint
        if latest is None or latest.name != f"global_step_{self.step}":
            latest = self.save()
        print(export_checkpoint(latest, output_dir, overwrite=overwrite), flush=True)
        return Path(output_dir)

    def _step(self) -> dict[str, float]:
        c, last = self.config, self.step == self.total_steps
        start = time.perf_counter()
        self.model.train()
        if self.device.type == "cpu":
            follow_free_cores()  # torch's threads on the cores other work leaves free
        metrics = with_loss_scale_retries(self.train_step, self.sampler.next())
        metrics["timing_s/step"] = time.perf_counter() - start
        if "train/tokens" in metrics:  # tokens through the policy's forward
            metrics["perf/throughput"] = metrics["train/tokens"] / metrics["timing_s/step"]
        # as verl's SFT trainer: validation and a checkpoint after the last step whatever the freqs say
        if self.val_examples and (last or due(c.trainer.test_freq, self.step, last=False)):
            self.model.eval()
            with torch.no_grad():
                metrics |= self.validate()
        if last or due(c.trainer.save_freq, self.step, last=False):
            start = time.perf_counter()
            self.save(metrics)
            metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
        self._log(metrics, self.step)
        return metrics

    def finish_step(self, sums: dict[str, float], tokens: int) -> dict[str, float]:
        """The optimizer step after a batch's backward passes; `sums` (its loss and metrics) as the
        step's metrics, with the gradient norm, learning rate and token count."""
        done = optimizer_step(
            self.model, self.optimizer, self.config.actor.optim.grad_clip, {}, self.loss_scale
        )
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        out = {f"train/{k}" if k == "loss" else k: v for k, v in sums.items()}
        return out | {
            "train/grad_norm": done["grad_norm"] if done else float("nan"),
            "train/lr": lr,
            "train/skipped_updates": float(done is None),
            "train/tokens": float(tokens),
        }

    def _log(self, metrics: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def save(self, metrics: dict[str, float] | None = None) -> Path:
        """Sharded state, the transformers export, and the step's `metrics` (for a kill between this
        save and their logging)."""

        def write_models(directory: Path) -> None:
            save_sharded(self.model, self.optimizer, directory / "actor_state")
            export_policy(self.model, directory / "policy", hf_config=self.hf_config, tokenizer=self.tokenizer,
                          base_model=self.config.model.path)  # fmt: skip

        self.last_checkpoint = save_checkpoint(
            self.run_dir,
            self.step,
            write_models=write_models,
            optim_state={"actor_scheduler": self.scheduler.state_dict()},
            trainer_state={
                "step": self.step,
                "sampler": self.sampler.state_dict(),
                "rng": rng_state(),
                "metrics_row": jsonl_row(metrics, self.step) if metrics is not None else None,
            },
            config_yaml=to_yaml(self.config),
            keep_last=self.config.trainer.keep_last_checkpoints,
        )
        return self.last_checkpoint

    def _resume(self) -> None:
        resume = self.config.trainer.resume
        unverified = self.config.trainer.resume_unverified
        path = latest_checkpoint(self.run_dir, unverified=unverified) if resume in ("auto", "force") else None
        self.last_checkpoint = path
        if path is None:
            truncate_jsonl(self.run_dir / "metrics.jsonl", 0)
            return
        check_resumable(path, to_yaml(self.config), force=resume == "force")
        state, schedulers = load_checkpoint_state(path)
        load_sharded(self.model, self.optimizer, path / "actor_state")
        self.scheduler.load_state_dict(schedulers["actor_scheduler"])
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        set_rng_state(state["rng"])
        truncate_jsonl(self.run_dir / "metrics.jsonl", self.step)
        restore_last_row(self.run_dir / "metrics.jsonl", self.step, state.get("metrics_row"))
        print(f"resumed from {path} (step {self.step})", flush=True)
