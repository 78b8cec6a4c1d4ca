"""A run's checkpoints from the controller's side: what a save adds to the workers' states (the
LR schedulers, the sampler, the KL controller, RNGs, the step's metrics row, an asynchronous run's
groups in flight) and how a resume puts it back. Given what they need, they return what they produce:
the controller keeps its own fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hybridflow.checkpoint import (
    check_resumable,
    latest_checkpoint,
    load_checkpoint_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from hybridflow.config import Config, to_yaml
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.errors import UserError
from hybridflow.tracking.sinks import jsonl_row, restore_last_row, truncate_jsonl


@dataclass
class RunState:
    """Where a run stands between two steps, kept in one place by the trainer: a checkpoint saves it
    (with the sampler's, the KL controller's and the stream's states: ControllerState) and a resume
    puts it back."""

    step: int = 0
    """The last step trained."""
    bad_steps: int = 0
    """Steps in a row whose update was skipped for a non-finite loss or gradient."""
    last_checkpoint: Path | None = None
    val_first: dict[str, float] = field(default_factory=dict)
    """The first validation's val-core means, and the latest's: the summary a run ends with."""
    val_last: dict[str, float] = field(default_factory=dict)


@dataclass
class ControllerState:
    """What the controller adds to the workers' states in a checkpoint (trainer_state.json)."""

    step: int
    sampler: dict
    """Where the next prompts are drawn: before those of step + 1 (an asynchronous run may have drawn them)."""
    kl_ctl: dict
    bad_steps: int
    in_flight: dict | None = None
    """An asynchronous run's groups admitted and not yet trained on, as far as they got."""


@dataclass
class Resumed(ControllerState):
    """A checkpoint the run goes on from (its workers have loaded their states and synced the engines)."""

    path: Path | None = None


def save_run(
    config: Config,
    run_dir: Path,
    workers,
    watchdog,
    state: ControllerState,
    metrics: dict[str, float] | None = None,
) -> Path:
    """The workers write the sharded model and optimizer states and the transformers exports; the
    controller adds the LR schedulers, its `state`, the RNGs, the config and the step's `metrics`
    (for a kill between this save and their logging). Returns the checkpoint's path."""
    schedulers: dict = {}

    def write_models(directory: Path) -> None:
        schedulers.update(workers.call(HybridWorker.save, str(directory))[0])

    trainer_state = {
        "step": state.step,
        "sampler": state.sampler,
        "kl_ctl": state.kl_ctl,
        "rng": rng_state(),
        "bad_steps": state.bad_steps,
        "metrics_row": jsonl_row(metrics, state.step) if metrics is not None else None,
        "in_flight": state.in_flight,
    }
    with watchdog.phase("save_checkpoint"):
        return save_checkpoint(
            run_dir,
            state.step,
            write_models=write_models,
            optim_state=schedulers,
            trainer_state=trainer_state,
            config_yaml=to_yaml(config),
            keep_last=config.trainer.keep_last_checkpoints,
            needed_bytes=sum(workers.call(HybridWorker.checkpoint_bytes)),
        )


def resume_run(config: Config, run_dir: Path, workers, placement) -> Resumed | None:
    """From the run directory's latest verified checkpoint (trainer.resume): the workers load their
    states and the engines get the weights; returns what the controller goes on with, or None for a
    fresh start (the metrics of an unsaved attempt forgotten)."""
    resume = config.trainer.resume
    unverified = config.trainer.resume_unverified
    path = latest_checkpoint(run_dir, unverified=unverified) if resume in ("auto", "force") else None
    if path is None:
        for name in ("metrics.jsonl", "samples.jsonl"):  # a fresh start forgets an unsaved attempt
            truncate_jsonl(run_dir / name, 0)
        return None
    check_resumable(path, to_yaml(config), force=resume == "force")
    state, schedulers = load_checkpoint_state(path)
    if not (path / "actor_state").is_dir():
        raise UserError(
            f"checkpoint {path} has no actor_state/ (written by an older hybridflow); start a new "
            "run from its policy/ directory (model.path) or pass --overwrite"
        )
    workers.call(HybridWorker.load, str(path), schedulers)
    placement.sync_weights()
    set_rng_state(state["rng"])
    in_flight = state.get("in_flight") if resume != "force" else None
    if resume == "force" and state.get("in_flight"):  # its lengths and sampling may no longer hold
        print(f"trainer.resume=force: the groups in flight at {path.name} are generated again from their "
              "prompts (the config may have changed under them)", flush=True)  # fmt: skip
    partial = sum(
        bool(r["ids"]) and r["finish"] is None for samples in (in_flight or {}).values() for r in samples
    )
    if partial and config.rollout.keep_kv_on_weight_update:
        print(f"{partial} sequences in flight at {path.name} go on with their K/V recomputed by the current "
              "weights (a checkpoint holds tokens, not K/V): rollout.keep_kv_on_weight_update makes this "
              "run differ from the uninterrupted one from here", flush=True)  # fmt: skip
    step = state["step"]
    for name in ("metrics.jsonl", "samples.jsonl"):
        truncate_jsonl(run_dir / name, step)
    restore_last_row(run_dir / "metrics.jsonl", step, state.get("metrics_row"))
    print(f"resumed from {path} (step {step})", flush=True)
    return Resumed(step, state["sampler"], state["kl_ctl"], state["bad_steps"], in_flight, path)
