"""The RL driver: one step of DESIGN.md's dataflow as role calls and pure functions."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import torch

from hybridflow import run_manifest
from hybridflow.algorithms.kl import AdaptiveKLController, FixedKLController
from hybridflow.batch import TrainingBatch
from hybridflow.checkpoint import writes_checkpoints
from hybridflow.config import Config, to_yaml
from hybridflow.config.sections_run import due
from hybridflow.controller.advantage import compute_advantages, token_level_rewards
from hybridflow.controller.divergence import count_bad_step, diverged
from hybridflow.controller.graceful_stop import GracefulStop, stop_with_checkpoint
from hybridflow.controller.guards import TrainingGuards
from hybridflow.controller.metrics import Timer, step_metrics
from hybridflow.controller.off_policy import engine_is_pi_old, needs_old_logprobs, set_old_logprobs
from hybridflow.controller.perf import peak_flops
from hybridflow.controller.placement import Placement
from hybridflow.controller.role_calls import RoleCalls
from hybridflow.controller.run_checkpoint import ControllerState, RunState, resume_run, save_run
from hybridflow.controller.run_dir import prepare_run_dir
from hybridflow.controller.setup import (
    check_config,
    check_environment,
    run_prompts,
    step_plan,
    updates_per_step,
)
from hybridflow.controller.step_batch import (
    actor_update_metrics,
    kl_in_reward,
    sampled_routes_metrics,
    training_batch,
)
from hybridflow.controller.summary import run_summary
from hybridflow.controller.watchdog import Watchdog
from hybridflow.controller.worker_group import WorkerError
from hybridflow.controller.worker_models import WorkerLayout
from hybridflow.data.sampler import PromptSampler
from hybridflow.devices import expandable_cuda_segments, follow_free_cores, resolve_device, seed_process
from hybridflow.disk_full import disk_full_error
from hybridflow.errors import UserError
from hybridflow.models.loading import load_model_tokenizer
from hybridflow.plan.layout import plan_run
from hybridflow.plan.memory import model_shape, pool_beside_training
from hybridflow.plan.out_of_memory import ran_out_of_memory
from hybridflow.rewards.hidden import hidden_paths
from hybridflow.roles.reward import Reward
from hybridflow.rollout.sampling import NonFiniteLogits
from hybridflow.stream.admission import engine_batch_note, max_staleness, step_sampling
from hybridflow.stream.batches import Taken, open_batches
from hybridflow.tracking.progress import bar
from hybridflow.tracking.samples import append_samples, sample_rows, val_sample_rows
from hybridflow.tracking.sinks import make_sinks


class RLTrainer:
    """`RLTrainer(config).fit()` trains the policy with the configured RL algorithm."""

    def __init__(
        self,
        config: Config,
        *,
        overwrite: bool = False,
        reward_function: Callable | None = None,
        write_inputs: Callable[[Path], None] | None = None,
    ) -> None:
        """`overwrite` deletes this run directory's earlier checkpoints and metrics (never other files).
        `reward_function`: a live verl-style function scored in this process (instead of the config's
        reward). `write_inputs(run_dir)` writes what the config names under run_dir/inputs (the Python
        API's live models and datasets) once the run directory is checked."""
        check_config(config)
        check_environment(config)
        self.config = c = config
        self.run_dir, self.run_lock = prepare_run_dir(c, overwrite=overwrite)
        try:
            self._set_up(reward_function, write_inputs)
        except BaseException:  # the directory is free again for the run that fixes the cause
            self.run_lock.release()
            raise

    def _set_up(self, reward_function: Callable | None, write_inputs: Callable[[Path], None] | None) -> None:
        """The workers, data, reward and sinks of a run whose directory is checked and locked."""
        c = self.config
        if write_inputs is not None:
            write_inputs(self.run_dir)
        seed_process(c.trainer.seed, deterministic=c.deterministic_processes)
        self.device = resolve_device(c.resources.device)
        if (
            self.device.type == "cpu"
            and c.resources.num_workers == 1
            and (note := follow_free_cores(start=True))
        ):
            print(note, flush=True)
        if note := engine_batch_note(c, on_gpu=self.device.type == "cuda"):
            print(note, flush=True)
        self.tokenizer = load_model_tokenizer(c.model)
        self.train_prompts, self.val_prompts = run_prompts(c, self.tokenizer, reward_function)
        self.sampler = PromptSampler(
            self.train_prompts, c.data.prompts_per_step, seed=c.trainer.seed, shuffle=c.data.shuffle
        )
        self.total_steps = (
            c.trainer.total_training_steps or c.trainer.total_epochs * self.sampler.steps_per_epoch
        )
        self.stop_at = self.total_steps  # fit(max_steps) may stop sooner or go on
        self._closed = False
        self.watchdog = Watchdog(0, self.run_dir)  # fit() runs one that is on
        self.guards = TrainingGuards(c.trainer.guards, exact=c.rollout.exact_logprobs)
        self._weight_check_unavailable_said = False
        self.reward = Reward(
            self.tokenizer,
            c.reward,
            max_response_tokens=c.data.max_response_tokens,
            # model-written code never sees the run's files, nor the data with its answers
            hide=hidden_paths(c),
            device=self.device,
            function=reward_function,
        )
        if c.rollout.agent.loop != "environment":  # an environment gives the rewards itself
            self.reward.check_sources({p.data_source for p in self.train_prompts + self.val_prompts})
        layout = WorkerLayout.of(c, 1)  # the roles every training worker holds
        self.needs_ref, self.has_critic = layout.needs_ref, layout.needs_critic
        if self.device.type == "cuda" and pool_beside_training(c, layout):
            expandable_cuda_segments()  # before the first CUDA allocation
        kv_pool_tokens = None  # the memory plan, made once here and handed to the workers
        if self.device.type == "cuda":  # before the models are built: an OOM it can predict is named first
            kv_pool_tokens = plan_run(c)
        self.peak_flops = peak_flops(self.device)  # for perf/mfu/actor, on accelerators we know
        self.model_shape = model_shape(c) if self.peak_flops else None
        self.placement = Placement(
            c, self.device, total_steps=self.total_steps, kv_pool_tokens=kv_pool_tokens
        )
        # a cluster's Ray workers may run niced: the scoring workers must not run ahead of them
        niceness = self.placement.ray_niceness()
        if niceness is not None:
            self.reward.run_at_niceness(niceness)
        self.workers = self.placement.train  # the workers that hold actor, reference and critic
        self.roles = RoleCalls(c, self.placement)
        kl = c.algorithm.kl_ctrl
        self.kl_ctl = (
            FixedKLController(kl.kl_coef)
            if kl.type == "fixed"
            else AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
        )
        self.state = RunState()  # where the run stands: step, bad steps, last checkpoint, validations
        in_flight = self._resume()  # a checkpoint's groups in flight, which the stream goes on with
        self.batches = open_batches(c, self.placement, self.roles, self.reward, self.sampler,
                                    lambda name: self.watchdog.phase(name), version=self.state.step,
                                    in_flight=in_flight, stop_at=self.stop_at)  # fmt: skip
        self.sinks = make_sinks(c.trainer.logger, self.run_dir, c)

    @property
    def step(self) -> int:
        """The last step trained (0 before the first)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:  # a caller that drives train_step itself (bench/vs_trl)
        self.state.step = value

    @property
    def last_checkpoint(self) -> Path | None:
        return self.state.last_checkpoint

    # ---- the loop -------------------------------------------------------------------------------
    def fit(self, max_steps: int | None = None, *, close: bool = True) -> dict[str, float]:
        """Train to step `max_steps` (default: the configured total, which also sets the LR schedule),
        validating and saving as configured and at the last step; the last step's metrics. `close`:
        release the workers, reward processes and sinks after (`close()` does it later)."""
        c = self.config
        self.stop_at = self.total_steps if max_steps is None else max_steps
        plan = step_plan(c, self.stop_at, len(self.train_prompts), self.sampler.steps_per_epoch)
        print(plan, flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        run_manifest.write_text_atomic(self.run_dir / "config.yaml", to_yaml(c))  # for the report
        run_manifest.write_text_atomic(self.run_dir / "step_plan.txt", plan + "\n")
        metrics: dict[str, float] = {}
        if self.state.step >= self.stop_at:
            print(
                f"{self.run_dir} already finished {self.state.step} steps: nothing to train. To start over pass "
                "--overwrite (in Python: RLTrainer(config, overwrite=True)); to go on, raise "
                "trainer.total_training_steps",
                flush=True,
            )
        self.progress = bar(self.stop_at, "steps", enabled=c.trainer.progress, initial=self.state.step)
        started, first_step = time.perf_counter(), self.state.step
        try:
            with (
                Watchdog(c.trainer.watchdog_s, self.run_dir) as self.watchdog,
                GracefulStop(writes_checkpoints(c.trainer.save_freq)) as stop,
            ):
                if self.state.step == 0 and c.trainer.val_before_train and self.val_prompts:
                    self._log(self._validate(), step=0)
                self.batches.start(self.stop_at)
                while self.state.step < self.stop_at and not stop.requested:
                    self.state.step += 1
                    self.watchdog.step = self.state.step
                    if self.device.type == "cpu":
                        follow_free_cores()  # other work on the machine may have come or gone
                    self.reward.set_step(self.state.step, self.stop_at)
                    try:
                        metrics = self.train_step()
                    except NonFiniteLogits as e:  # (generating ahead, a stream may hear it at the update)
                        raise diverged(f"step {self.state.step}: the policy's logits are not finite", lr=c.actor.optim.lr,
                                       checkpoint=self.state.last_checkpoint) from e  # fmt: skip
                    self._after_step(metrics)
                    self.progress.update()
                if stop.requested:
                    stop_with_checkpoint(self, stop.requested, stop.saves)
            self.watchdog = Watchdog(0, self.run_dir)  # off between fits (evaluate, save)
        except WorkerError as e:  # a worker died or raised: say where the run can go on from
            self.run_lock.release()  # the same command (in this process too) must find it free
            if (oom := ran_out_of_memory(c, self.watchdog, self.state.step, e)) is not None:
                raise oom from e
            where = (
                f"the latest complete checkpoint is {self.state.last_checkpoint}; the same command resumes from it"
                if self.state.last_checkpoint is not None
                else "no checkpoint was written yet: the same command starts over"
            )
            raise WorkerError(f"{e}\n{where}") from e
        except BaseException as e:
            self.run_lock.release()
            # a stream's thread stops generating for a run that ended
            with contextlib.suppress(Exception):  # (a dead worker must not hide the first error)
                self.batches.close()
            if (oom := ran_out_of_memory(c, self.watchdog, self.state.step, e)) is not None:
                raise oom from e
            if (full := disk_full_error(e, self.run_dir, self.state.last_checkpoint)) is not None:
                raise full from e
            raise
        finally:  # the report is written at the end, and on an error or an interruption too
            self.progress.close()
            self._write_report()
        print(
            run_summary(
                self.run_dir,
                steps=self.state.step - first_step,
                seconds=time.perf_counter() - started,
                first_val=self.state.val_first,
                last_val=self.state.val_last,
                checkpoint=self.state.last_checkpoint,
                keep_last=c.trainer.keep_last_checkpoints,
            ),
            flush=True,
        )
        if close:
            self.close()
        return metrics

    def close(self) -> None:
        """Release the workers, the reward processes and the sinks (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        # each part is released even if one before it raises (a stream over a dead worker does): the
        # first error is raised after, once the workers' devices are given back and the lock released
        with contextlib.ExitStack() as release:
            release.callback(self.run_lock.release)
            release.callback(self.placement.shutdown)
            release.callback(self.reward.close)
            release.callback(self.batches.close)
            for sink in self.sinks:
                release.callback(sink.close)

    def evaluate(self) -> dict[str, float]:
        """Validation metrics (val-core/...) of the current policy on the configured val files."""
        if not self.val_prompts:
            raise UserError("no validation prompts: set data.val_files (or pass eval_dataset)")
        return self._validate()

    def _after_step(self, metrics: dict[str, float]) -> None:
        """Validation and checkpoint when due, then the step's metrics to the sinks."""
        c, last = self.config, self.state.step == self.stop_at
        if self.val_prompts and due(c.trainer.test_freq, self.state.step, last):
            start = time.perf_counter()
            metrics |= self._validate()
            metrics["timing_s/testing"] = time.perf_counter() - start
        try:
            if due(c.trainer.save_freq, self.state.step, last):
                start = time.perf_counter()
                self.save(metrics)
                metrics["timing_s/save_checkpoint"] = time.perf_counter() - start
        finally:  # a failed save still records the step it followed
            self._log(metrics, step=self.state.step)

    def _write_report(self) -> None:
        try:
            from hybridflow.report import write_report

            print(f"report: {write_report([self.run_dir])}", flush=True)
        except Exception as e:  # a report must never hide how the run ended
            print(f"report not written ({type(e).__name__}: {e})", flush=True)

    def train_step(self) -> dict[str, float]:
        """One step of DESIGN.md's dataflow: the step's batch from its source, pi_old, the reference,
        the critic's values, advantages, the updates, and the new weights into the engines."""
        c, timer = self.config, Timer(on_start=self._show_phase, around=self.watchdog.phase)
        with timer("step"):
            with timer("gen"):
                taken = self.batches.take(self.state.step)
            metrics = taken.metrics | sampled_routes_metrics(c, taken.rollouts)
            batch = training_batch(c, taken.rollouts, step=self.state.step)
            actor_mask = batch.response_mask  # less the tokens a rollout correction rejects
            if needs_old_logprobs(c, len(batch), stale=max_staleness(c) > 0):
                # nothing to recompute, nothing to time
                bypass = c.algorithm.rollout_correction.bypass_mode or engine_is_pi_old(c, batch)
                with contextlib.nullcontext() if bypass else timer("old_log_prob"):
                    actor_mask, corrections = set_old_logprobs(c, batch, self._old_logprobs)
                metrics |= corrections
            if c.actor.router_replay == "R2":  # one update on-policy: its own pass is pi_old's, none replayed
                metrics["router_replay/recorded_fraction"] = float(batch.routed_experts is not None)
            if self.needs_ref:
                with timer("ref"):
                    batch.ref_logprobs = self.roles.ref_log_probs(batch)
            if self.has_critic:
                with timer("values"):
                    batch.old_values = self.roles.values(batch)
            with timer("adv"):
                token_rewards = token_level_rewards(taken.scored.scores, batch.response_mask)
                if c.algorithm.use_kl_in_reward:
                    token_rewards, kl_metrics = kl_in_reward(c, token_rewards, batch, self.kl_ctl)
                    metrics |= kl_metrics
                batch.advantages, batch.returns = compute_advantages(
                    c.algorithm,
                    token_rewards=token_rewards,
                    mask=batch.response_mask,
                    group_ids=taken.rollouts.group_ids,
                    values=batch.old_values,
                    baselines=taken.baselines,
                )
            if self.has_critic:
                with timer("update_critic"):
                    metrics |= self.roles.update_critic(batch, epochs=c.actor.ppo_epochs)
            if self.state.step > c.critic.warmup_steps:
                with timer("update_actor"):
                    update = self.roles.update_actor(dataclasses.replace(batch, response_mask=actor_mask))
                    metrics |= actor_update_metrics(c, update)
                self.state.bad_steps = count_bad_step(self.state.bad_steps, metrics, updates=updates_per_step(c),
                                                step=self.state.step, checkpoint=self.state.last_checkpoint)  # fmt: skip
            with timer("update_weights"):
                metrics |= self.batches.update_weights(version=self.state.step)
            if c.trainer.guards.weight_sync_check:
                with timer("weight_check"):
                    self._check_weight_sync()
            self.guards.check(self.state.step, metrics)
        return metrics | self._step_report(taken, batch, token_rewards, timer)

    def _old_logprobs(self, batch: TrainingBatch) -> torch.Tensor:
        """pi_old's log-probs; with router replay R2 the experts its pass routed to become what every
        update replays."""
        if self.config.actor.router_replay != "R2":
            return self.roles.log_probs(batch)
        logprobs, batch.routed_experts = self.roles.log_probs_and_routes(batch)
        return logprobs

    def _step_report(self, taken: Taken, batch: TrainingBatch, token_rewards: torch.Tensor, timer: Timer
                     ) -> dict[str, float]:  # fmt: skip
        """The step's memory, data, timing and throughput metrics; its samples logged when due."""
        c, step = self.config, self.state.step
        metrics = self.roles.memory_metrics() | step_metrics(
            taken.rollouts, taken.scored, batch, token_rewards, timer, reward_s=taken.metrics.get("timing_s/reward", 0.0),
            devices=self.placement.world_size, shape=self.model_shape, actor_passes=c.actor.ppo_epochs,
            peak=self.peak_flops,
        )  # fmt: skip
        metrics["training/epoch"] = float(taken.epoch)
        freq = c.trainer.log_samples_freq
        if freq and (step == 1 or step % freq == 0):
            self._log_samples(sample_rows(step, taken.rollouts, taken.scored.scores, batch.advantages,
                                          batch.response_mask, self.tokenizer, c.trainer.log_samples))  # fmt: skip
        return metrics

    def _show_phase(self, name: str) -> None:
        if getattr(self, "progress", None) is not None and name != "step":
            self.progress.set_postfix_str(name, refresh=True)

    def _log_samples(self, rows: list[dict]) -> None:
        append_samples(self.run_dir / "samples.jsonl", rows)
        for sink in self.sinks:
            if hasattr(sink, "log_samples"):
                sink.log_samples(rows, self.state.step)

    # ---- pieces of a step ------------------------------------------------------------------------
    def _validate(self) -> dict[str, float]:
        r = self.config.rollout
        params = step_sampling(self.config, -1, self.state.step, n=r.val_samples_per_prompt, temperature=r.val_temperature,
                               top_p=r.val_top_p, top_k=r.val_top_k)  # fmt: skip
        with self.watchdog.phase("validation"):
            metrics, samples = self.batches.validate(self.val_prompts, params)
        if self.config.trainer.log_val_generations:
            rows = val_sample_rows(
                self.state.step,
                samples,
                self.val_prompts,
                self.tokenizer,
                self.config.trainer.log_val_generations,
            )
            append_samples(self.run_dir / "val_samples.jsonl", rows)
        return metrics

    def _check_weight_sync(self) -> None:
        if not self.placement.check_weight_sync(self.state.step) and not self._weight_check_unavailable_said:
            self._weight_check_unavailable_said = True
            print(f"weight-sync check: rollout.name={self.config.rollout.name} does not expose its weights; "
                  "not checked", flush=True)  # fmt: skip

    def _log(self, metrics: dict[str, float], *, step: int) -> None:
        val = {k: v for k, v in metrics.items() if k.startswith("val-core/") and "/mean@" in k}
        if val:
            self.state.val_first = self.state.val_first or val
            self.state.val_last = val
        for sink in self.sinks:
            sink.log(metrics, step)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self, metrics: dict[str, float] | None = None) -> Path:
        """A checkpoint of this step (controller/run_checkpoint.py); `metrics`: the step's row, for a
        kill between this save and their logging."""
        point = self.batches.resume_point(self.state.step)
        state = ControllerState(
            self.state.step, point.sampler, self.kl_ctl.state_dict(), self.state.bad_steps, point.in_flight
        )
        self.state.last_checkpoint = save_run(
            self.config, self.run_dir, self.workers, self.watchdog, state, metrics
        )
        return self.state.last_checkpoint

    def _resume(self) -> dict | None:
        """Go on from the run directory's latest checkpoint, if any; its groups in flight."""
        resumed = resume_run(self.config, self.run_dir, self.workers, self.placement)
        if resumed is None:
            return None
        self.state = RunState(resumed.step, resumed.bad_steps, resumed.path)
        self.sampler.load_state_dict(resumed.sampler)
        self.kl_ctl.load_state_dict(resumed.kl_ctl)
        return resumed.in_flight
