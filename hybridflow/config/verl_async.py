"""verl's recipes with the engine on GPUs of its own, read from their keys together: the
one-step-off-policy recipe (`hybrid_engine=False` with `rollout.n_gpus_per_node`) and the fully
asynchronous one (any `async_training.*` key; its YAML's defaults for the keys not given).

A weight version there spans `trigger_parameter_sync_step x require_batches x ppo_mini_batch_size`
prompts, one optimizer update per `ppo_mini_batch_size`, and `staleness_threshold` is the share of
the next version's samples the rollout may generate ahead. Here one step is one weight version: its
prompts are that product, its updates are `actor.sequences_per_update` apart as before, and the
threshold is `rollout.max_staleness` (a fraction admits that share of the next step's groups early).

`ENTRIES` are these keys' rows of verl's table (config/aliases.py); `disaggregated` reads them.
Every value it reads is checked first: a value that is not a number or a boolean stops the run
naming the key, never read as False or 0.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config.verl_rules import Entry, Translation, by_value, no_effect, rename

ARR = "actor_rollout_ref"
# verl's fully_async_ppo_trainer.yaml
ASYNC_DEFAULTS = {
    "staleness_threshold": 0.1,
    "trigger_parameter_sync_step": 4,
    "require_batches": 1,
    "partial_rollout": True,
    "use_rollout_log_probs": True,
    "compute_prox_log_prob": False,
}
VERL_MINI_BATCH = 256  # verl's default actor.ppo_mini_batch_size (prompts)
RESOURCE_KEYS = ("resources.n_gpus_per_node", "resources.nnodes", "resources.rollout_workers")
SYNC_NOTE = "weights go from the actor to the rollout workers by NCCL broadcast, one decoder layer at a time"


def read_together(value: Any) -> Translation:
    return Translation()  # read with the keys it goes with (disaggregated, below)


ENTRIES: dict[str, Entry] = {
    "rollout.nnodes": by_value(read_together, "`resources.rollout_workers`", "x rollout.n_gpus_per_node"),
    "rollout.n_gpus_per_node": by_value(
        read_together,
        "`resources.rollout_workers`",
        "rollout workers = rollout.nnodes x this, each an engine on a GPU of its own, added to the trainer's GPUs; with `hybrid_engine=False` and no `async_training.*` key: verl's one_step_off_policy (`trainer.async_mode=one_step`)",
    ),
    "rollout.total_rollout_steps": by_value(
        read_together,
        "`trainer.total_training_steps`",
        "prompts in verl: divided by the prompts of one weight version",
    ),
    "rollout.test_freq": rename("trainer.test_freq", "in weight versions, which are our steps"),
    "trainer.weight_sync_with_ray": no_effect(SYNC_NOTE),
    "async_training.staleness_threshold": by_value(
        read_together,
        "`rollout.max_staleness`",
        "the share of the next version's samples generated ahead: that share of the next step's groups is admitted early (0 is the synchronous run)",
    ),
    "async_training.trigger_parameter_sync_step": by_value(
        read_together,
        "`data.prompts_per_step`",
        "a step is one weight version: trigger_parameter_sync_step x require_batches x ppo_mini_batch_size prompts (`data.train_batch_size` does not count, as in verl)",
    ),
    "async_training.require_batches": by_value(
        read_together, "`data.prompts_per_step`", "see trigger_parameter_sync_step"
    ),
    "async_training.partial_rollout": by_value(
        read_together,
        "`trainer.async_mode`",
        "True: streaming (a weight update reaches sequences in flight, which go on under it); False: one_step (an update waits for them; threshold <= 1)",
    ),
    "async_training.use_rollout_log_probs": by_value(
        read_together,
        "`algorithm.rollout_correction.bypass_mode`",
        "True (verl's default): pi_old is the rollout's own log-probs, nothing recomputed",
    ),
    f"{ARR}.actor.use_rollout_log_probs": by_value(
        read_together, "`algorithm.rollout_correction.bypass_mode`", "as async_training.use_rollout_log_probs"
    ),
    "async_training.compute_prox_log_prob": by_value(
        read_together,
        "`algorithm.rollout_correction.bypass_mode=false`",
        "True: the trainer recomputes pi_old (decoupled PPO), for `algorithm.rollout_correction.rollout_is`",
    ),
    "async_training.use_trainer_do_validate": no_effect(
        "validation generates on the rollout engine between two steps, wherever it runs"
    ),
    "async_training.checkpoint_engine.enable": no_effect(SYNC_NOTE),
    "async_training.checkpoint_engine.device_buffer_size_M": no_effect(
        "the broadcast buffer is one decoder layer"
    ),
    "async_training.checkpoint_engine.overlap_broadcast_and_consume": no_effect(
        "each layer is copied into the engine as it arrives"
    ),
    "async_training.compute_advantage_in_rollout": no_effect(
        "advantages are computed when a step's groups are taken, from the whole groups"
    ),
}


class _Values:
    """The verl values `disaggregated` reads, each checked: problems collect one line per bad value."""

    TRUE, FALSE = (True, "True", "true", 1, "1"), (False, "False", "false", 0, "0")

    def __init__(self, verl: dict[str, Any]) -> None:
        self.verl, self.problems = verl, []

    def flag(self, key: str, default: Any) -> bool:
        value = self.verl.get(key, default)
        if value in self.TRUE or value in self.FALSE:
            return value in self.TRUE
        self.problems.append(f"{key}={value!r} must be True or False")
        return bool(default)

    def number(self, key: str, default: Any, kind: type, minimum: float) -> Any:
        value = self.verl.get(key, default)
        try:
            number = kind(value)
            if kind is int and number != float(value):
                raise ValueError
        except (TypeError, ValueError):
            self.problems.append(f"{key}={value!r} must be {'a whole number' if kind is int else 'a number'}")
            return kind(default) if default is not None else kind(minimum)
        if number < minimum:
            self.problems.append(f"{key}={value!r} must be >= {minimum:g}")
            return kind(minimum)
        return number


def disaggregated(
    verl: dict[str, Any], ours: set[str] = frozenset()
) -> tuple[list[tuple[str, Any]], list[str], list[str]]:
    """(our settings, notes, problems) from the verl keys given (recipe and command, later wins) and
    the names of our own keys given beside them."""
    v = _Values(verl)
    hybrid = v.flag(f"{ARR}.hybrid_engine", True)
    gpus = verl.get("rollout.n_gpus_per_node")
    fully_async = any(k.startswith("async_training.") for k in verl)
    if hybrid:
        if gpus is not None:
            v.problems.append(
                f"rollout.n_gpus_per_node={gpus} gives the engine GPUs of its own: set "
                f"{ARR}.hybrid_engine=False as verl's recipes do"
            )
        if v.problems or not fully_async:
            return [], [], v.problems
        settings: list[tuple[str, Any]] = []
        notes = [
            "async_training.*: the engine shares the trainer's GPU (hybrid_engine=True), generating beside it"
        ]
    else:
        if gpus is None:
            return (
                [],
                [],
                [
                    *v.problems,
                    f"{ARR}.hybrid_engine=False: give the engine GPUs of its own with rollout.n_gpus_per_node "
                    "(and rollout.nnodes), as verl's recipes do, or resources.rollout_workers=N",
                ],
            )
        mixed = [k for k in RESOURCE_KEYS if k in ours]
        if mixed:  # verl's GPU counts would silently replace them
            v.problems.append(
                f"{', '.join(mixed)} beside verl's rollout.n_gpus_per_node: give the GPUs one way, verl's "
                "trainer.* / rollout.* counts or our resources.*"
            )
        settings = _workers(v)
        if v.problems:
            return [], [], v.problems
        notes = []
        if not fully_async:
            return (
                [*settings, ("trainer.async_mode", "one_step")],
                [
                    f"verl's one_step_off_policy: {settings[-1][1]} rollout worker(s) generate step k+1 while "
                    "the trainer trains on step k (trainer.async_mode=one_step)"
                ],
                [],
            )
    return _fully_async(v, settings, notes)


def _workers(v: _Values) -> list[tuple[str, Any]]:
    """verl counts the trainer's GPUs (trainer.*) and the rollout's (rollout.*) apart; here
    resources.n_gpus_per_node x nnodes counts all workers, the last resources.rollout_workers of them
    the rollout's."""
    r_gpus, r_nodes = v.number("rollout.n_gpus_per_node", 1, int, 1), v.number("rollout.nnodes", 1, int, 1)
    t_gpus, t_nodes = v.number("trainer.n_gpus_per_node", 1, int, 1), v.number("trainer.nnodes", 1, int, 1)
    if t_nodes == 1 and r_nodes == 1:  # one node holds both, as in verl's single-node scripts
        per_node, nodes = t_gpus + r_gpus, 1
    elif t_gpus == r_gpus:  # whole nodes each
        per_node, nodes = t_gpus, t_nodes + r_nodes
    else:
        v.problems.append(
            f"trainer {t_nodes} x {t_gpus} GPUs and rollout {r_nodes} x {r_gpus} GPUs do not make whole nodes "
            "of one size: set resources.n_gpus_per_node, resources.nnodes and resources.rollout_workers"
        )
        return []
    return [
        ("resources.n_gpus_per_node", per_node),
        ("resources.nnodes", nodes),
        ("resources.rollout_workers", r_gpus * r_nodes),
    ]


def _fully_async(v: _Values, settings, notes):
    key = "async_training."
    threshold = v.number(key + "staleness_threshold", ASYNC_DEFAULTS["staleness_threshold"], float, 0)
    partial = v.flag(key + "partial_rollout", ASYNC_DEFAULTS["partial_rollout"])
    rollout_logprobs = v.flag(f"{ARR}.actor.use_rollout_log_probs", ASYNC_DEFAULTS["use_rollout_log_probs"])
    if key + "use_rollout_log_probs" in v.verl:  # the recipe's own key wins
        rollout_logprobs = v.flag(key + "use_rollout_log_probs", True)
    recompute = v.flag(key + "compute_prox_log_prob", ASYNC_DEFAULTS["compute_prox_log_prob"])
    prompts = (
        v.number(key + "trigger_parameter_sync_step", ASYNC_DEFAULTS["trigger_parameter_sync_step"], int, 1)
        * v.number(key + "require_batches", ASYNC_DEFAULTS["require_batches"], int, 1)
        * v.number(f"{ARR}.actor.ppo_mini_batch_size", VERL_MINI_BATCH, int, 1)
    )
    if not partial and threshold > 1:
        v.problems.append(
            f"async_training.partial_rollout=False with staleness_threshold={threshold}: without partial "
            "rollouts a weight update waits for the groups in flight, which bounds staleness at 1; "
            "use partial_rollout=True or a threshold <= 1"
        )
    settings += [
        ("trainer.async_mode", "streaming" if partial else "one_step"),
        ("rollout.max_staleness", threshold),
        ("data.prompts_per_step", prompts),
        # verl's default: pi_old is the rollout's own log-probs; compute_prox_log_prob recomputes it
        ("algorithm.rollout_correction.bypass_mode", rollout_logprobs and not recompute),
    ]
    notes.append(
        f"verl's fully_async_policy: a step is one weight version of trigger_parameter_sync_step x "
        f"require_batches x ppo_mini_batch_size = {prompts} prompts (data.prompts_per_step; "
        f"data.train_batch_size does not count, as in verl), rollout.max_staleness={threshold}, "
        f"trainer.async_mode={'streaming' if partial else 'one_step'}"
    )
    if "rollout.total_rollout_steps" in v.verl:
        total = v.number("rollout.total_rollout_steps", None, int, 1)
        steps = total // prompts
        if steps < 1:
            v.problems.append(
                f"rollout.total_rollout_steps={total} is fewer prompts than one weight version ({prompts})"
            )
        settings.append(("trainer.total_training_steps", steps))
        if total % prompts:
            notes.append(
                f"rollout.total_rollout_steps={total} is {steps} steps of {prompts} prompts; the last "
                f"{total % prompts} are not generated"
            )
    return settings, notes, v.problems
