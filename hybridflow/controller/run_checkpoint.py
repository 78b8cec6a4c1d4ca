"""A run's checkpoints from the controller's side: what a save adds to the workers' states (the
LR schedulers, the sampler, the KL controller, RNGs, the step's metrics row, an asynchronous run's
groups in flight) and how a resume puts it back. `trainer` is the RLTrainer."""

from __future__ import annotations

from pathlib import Path

from hybridflow.checkpoint import (
    check_resumable,
    latest_checkpoint,
    load_checkpoint_state,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from hybridflow.config import to_yaml
from hybridflow.controller.hybrid_worker import HybridWorker
from hybridflow.errors import UserError
from hybridflow.tracking.sinks import jsonl_row, restore_last_row, truncate_jsonl


def save_run(trainer, metrics: dict[str, float] | None = None) -> Path:
    """The workers write the sharded model and optimizer states and the transformers exports;
    the controller adds the LR schedulers, its own state, the config and the step's `metrics` (for
    a kill between this save and their logging)."""
    schedulers: dict = {}

    def write_models(directory: Path) -> None:
        schedulers.update(trainer.workers.call(HybridWorker.save, str(directory))[0])

    state = {
        "step": trainer.step,
        "sampler": trainer.sampler_state(),
        "kl_ctl": trainer.kl_ctl.state_dict(),
        "rng": rng_state(),
        "bad_steps": trainer.bad_steps,
        "metrics_row": jsonl_row(metrics, trainer.step) if metrics is not None else None,
        # an asynchronous run's groups admitted and not yet trained on, as far as they got
        "in_flight": trainer.stream.snapshot() if trainer.stream is not None else None,
    }
    with trainer.watchdog.phase("save_checkpoint"):
        return save_checkpoint(
            trainer.run_dir,
            trainer.step,
            write_models=write_models,
            optim_state=schedulers,
            trainer_state=state,
            config_yaml=to_yaml(trainer.config),
            keep_last=trainer.config.trainer.keep_last_checkpoints,
            needed_bytes=sum(trainer.workers.call(HybridWorker.checkpoint_bytes)),
        )


def resume_run(trainer) -> None:
    """From the run directory's latest verified checkpoint (trainer.resume), or a fresh start."""
    resume = trainer.config.trainer.resume
    unverified = trainer.config.trainer.resume_unverified
    path = latest_checkpoint(trainer.run_dir, unverified=unverified) if resume in ("auto", "force") else None
    if path is None:
        for name in ("metrics.jsonl", "samples.jsonl"):  # a fresh start forgets an unsaved attempt
            truncate_jsonl(trainer.run_dir / name, 0)
        return
    check_resumable(path, to_yaml(trainer.config), force=resume == "force")
    state, schedulers = load_checkpoint_state(path)
    if not (path / "actor_state").is_dir():
        raise UserError(
            f"checkpoint {path} has no actor_state/ (written by an older hybridflow); start a new "
            "run from its policy/ directory (model.path) or pass --overwrite"
        )
    trainer.workers.call(HybridWorker.load, str(path), schedulers)
    trainer.placement.sync_weights()
    trainer.step, trainer.bad_steps = state["step"], state["bad_steps"]
    trainer.sampler.load_state_dict(state["sampler"])
    trainer.kl_ctl.load_state_dict(state["kl_ctl"])
    set_rng_state(state["rng"])
    trainer.in_flight = state.get("in_flight") if resume != "force" else None
    if resume == "force" and state.get("in_flight"):  # its lengths and sampling may no longer hold
        print(f"trainer.resume=force: the groups in flight at {path.name} are generated again from their "
              "prompts (the config may have changed under them)", flush=True)  # fmt: skip
    partial = sum(
        bool(r["ids"]) and r["finish"] is None
        for samples in (trainer.in_flight or {}).values()
        for r in samples
    )
    if partial and trainer.config.rollout.keep_kv_on_weight_update:
        print(f"{partial} sequences in flight at {path.name} go on with their K/V recomputed by the current "
              "weights (a checkpoint holds tokens, not K/V): rollout.keep_kv_on_weight_update makes this "
              "run differ from the uninterrupted one from here", flush=True)  # fmt: skip
    trainer.last_checkpoint = path
    for name in ("metrics.jsonl", "samples.jsonl"):
        truncate_jsonl(trainer.run_dir / name, trainer.step)
    restore_last_row(trainer.run_dir / "metrics.jsonl", trainer.step, state.get("metrics_row"))
    print(f"resumed from {path} (step {trainer.step})", flush=True)
