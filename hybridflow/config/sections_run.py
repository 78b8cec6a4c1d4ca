"""The run: its steps, validation, checkpoints, logging, guards, and the resources it uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.config.checks import check_choice
from hybridflow.errors import UserError


@dataclass
class GuardsConfig:
    """Checks against training on wrong numbers, each on by default (controller/guards.py)."""

    max_probs_gap: float = 0.1
    """At an on-policy step, the largest mean |p_rollout - p_trainer| over response tokens; above it
    the run stops (the two sides are not running one policy). 0: off."""
    max_first_ppo_kl: float = 0.01
    """Where old log-probs are recomputed, the largest |ppo_kl| of a step's first mini-batch (the
    policy has not moved yet); above it the run stops. 0: off."""
    weight_sync_check: bool = True
    """After every weight sync, sampled elements of a few tensors must be equal in the trainer and in
    every engine (LoRA: the merged adapted layers)."""
    gap_growth_warning: bool = True
    """Warn once when the rollout/trainer probability gap keeps growing, naming the step it began."""


def due(freq: int | None, step: int, last: bool) -> bool:
    """Whether trainer.save_freq / test_freq call for a checkpoint / validation after `step` (None: the
    last step only; N > 0: every N steps and the last; 0 or less: never, verl's meaning)."""
    if freq is None:
        return last
    return freq > 0 and (last or step % freq == 0)


@dataclass
class TrainerConfig:
    total_training_steps: int | None = None
    """None: run `total_epochs` passes over the training prompts."""
    total_epochs: int = 1
    """Passes over the training prompts when total_training_steps is None."""
    save_freq: int | None = None
    """Save a checkpoint every N steps and after the last one. None: after the last step only. 0 or
    -1: never, as in verl's RL trainer (whose default -1 saves nothing, and whose commands set it to
    save nothing): the run says so when it starts, and its trained weights are not kept. The offline
    trainers (sft, dpo, kto) save after the last step whatever it says, as verl's SFT trainer does."""
    test_freq: int | None = None
    """Validate every N steps and after the last one. None: after the last step only. 0 or -1: never
    during the run, as in verl's RL trainer (val_before_train still validates before the first step).
    The offline trainers validate after the last step whatever it says, as verl's SFT trainer does."""
    val_before_train: bool = True
    """Validate once before the first step (the step-0 numbers of the curves)."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """Any of console, jsonl, tensorboard (RUN_DIR/tensorboard), wandb (WANDB_MODE=offline works),
    prometheus (the last step's metrics on http://prometheus_host:prometheus_port/metrics).
    RUN_DIR/metrics.jsonl is written whatever this lists (the report and a resume read it)."""
    prometheus_host: str = "127.0.0.1"
    """Address of the prometheus logger's /metrics."""
    prometheus_port: int = 9400
    """Port of the prometheus logger's /metrics."""
    log_samples_freq: int = 10
    """Every N steps (and at step 1) a few generations go to RUN_DIR/samples.jsonl; 0: never."""
    log_samples: int = 4
    """How many generations each time, each from a different prompt."""
    log_val_generations: int = 0
    """Each validation writes its first N responses (prompt, response, score, the reward's prediction)
    to RUN_DIR/val_samples.jsonl; 0: none (verl's key; verl sends them to its logger)."""
    progress: bool = True
    """A progress bar over the steps (with ETA and the phase running) when stderr is a terminal."""
    project_name: str = "hybridflow"
    """Project name for the loggers (wandb's project)."""
    experiment_name: str = "run"
    """The run's name for the loggers and the default run directory."""
    run_dir: str = "runs/${trainer.experiment_name}"
    """Where the run writes its config, metrics, samples, report and checkpoints; it also resumes from there."""
    resume: str = "auto"
    """'auto' goes on from the run directory's latest checkpoint (refused when it was made with another
    model, data or algorithm), 'force' goes on from it even then, 'disable' never resumes."""
    resume_unverified: bool = False
    """Resume from a checkpoint whose manifest.json is missing, empty or malformed (one written before
    manifests existed); by default such a checkpoint is skipped, named, like a damaged one."""
    keep_last_checkpoints: int = 1
    """Checkpoints kept (the latest N; resuming needs only the latest). Each holds the weights and
    optimizer state for resuming and the policy as a transformers directory: the run prints what
    one costs."""
    async_mode: str = "off"
    """How generation and training overlap. 'off': generate the step's batch, then train on it
    (verl's synchronous PPO loop). 'one_step': the next step's groups are generated with the current
    weights while the trainer updates them (trained one update late; verl's one-step-off-policy).
    'streaming': groups are generated, scored and buffered continuously, weight updates reach the
    engine between two of its steps with sequences in flight (partial rollouts: their later tokens come
    from the newer policy, every token records its version), and a group is admitted only while it
    will be within rollout.max_staleness updates of the policy that trains on it. The off-policy
    corrections are algorithm.rollout_correction's; the step's metrics add async/* (staleness, waits)."""
    max_restarts: int = 0
    """`hybridflow train`: when a worker dies or raises (its rank and traceback are printed), start the
    run again from its latest checkpoint, up to this many times; 0: stop with the error."""
    seed: int = 0
    """Seeds the prompt order, the weights' random parts and the sampling streams: the same seed gives the same
    run."""
    deterministic: bool = False
    """On a GPU, torch's deterministic algorithms in every process of the run (devices.seed_process): two
    runs of one config and seed, started separately, repeat to the bit. Without it a training step's
    atomics let them part in the last bits after a few steps (H100, 0.5B shape: step 4, weights 3e-5
    apart after 10 steps; with it equal after 10, synchronous: bench/repeatable_runs.py, docs/benchmarks.md;
    with exact log-probs too, equal after 10 synchronous and streaming). CPU runs repeat without it, at
    one torch thread count. rollout.exact_logprobs turns it on too."""
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    """Checks that stop a run training on wrong numbers (GuardsConfig)."""
    watchdog_s: float = 3600.0
    """A phase of a step (generation, reward, an update, the weight sync, validation, a checkpoint)
    running longer than this is stuck: every thread's stack goes to RUN_DIR/stacks-stepN.txt and the
    run stops with a line naming the phase (exit status 3). 0 turns the watchdog off."""

    def __post_init__(self) -> None:
        check_choice("trainer", "resume", self.resume, ("auto", "disable", "force"))
        if self.async_mode in ("False", "false"):  # YAML 1.1 reads a bare `off` as false
            self.async_mode = "off"
        check_choice("trainer", "async_mode", self.async_mode, ("off", "one_step", "streaming"))


@dataclass
class ResourcesConfig:
    device: str = "auto"
    """'auto' (cuda when present), 'cpu' or 'cuda'."""
    n_gpus_per_node: int = 1
    """GPUs used on each node (one worker each)."""
    nnodes: int = 1
    """Nodes of the Ray cluster used."""
    num_workers: int = 1
    """Workers on CPU (device=cpu): more than one runs them as Ray actors joined with gloo, the
    distributed path on a laptop. On GPUs the worker count is n_gpus_per_node x nnodes."""
    rollout_workers: int = 0
    """0: the rollout engine shares every worker's GPU (the hybrid engine). N: the last N workers
    hold only a rollout engine each (disaggregated) and receive the actor's weights by broadcast."""
    max_rollout_worker_replacements: int = 3
    """An asynchronous run with rollout workers: how many times in a run a rollout worker that dies
    is replaced (a new one in its place, given the current weights and the groups it had not handed
    over) before the run stops. A training worker that dies always stops the run (see
    trainer.max_restarts)."""
    ray_address: str | None = None
    """An existing Ray cluster to join (multi-node); None starts a local one when needed."""
    worker_timeout_s: float | None = None
    """Longest wait for one call on the workers (None: no limit). Past it the run stops, naming the
    ranks still busy, and the workers on this node write their stacks to their logs. Starting the
    workers (placing them, building their roles) gets at least 300 s whatever this says, and placing
    them never waits longer than that."""

    def __post_init__(self) -> None:
        check_choice("resources", "device", self.device, ("auto", "cpu", "cuda"))
        if self.rollout_workers < 0:
            raise UserError(f"config resources.rollout_workers={self.rollout_workers} must be >= 0")
        if self.max_rollout_worker_replacements < 0:
            raise UserError(
                f"config resources.max_rollout_worker_replacements={self.max_rollout_worker_replacements} "
                "must be >= 0"
            )
