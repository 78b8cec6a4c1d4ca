"""verl's recipes with the engine on GPUs of its own, read from their keys together: the
one-step-off-policy recipe (`hybrid_engine=False` with `rollout.n_gpus_per_node`) and the fully
asynchronous one (any `async_training.*` key; its YAML's defaults for the keys not given).

A weight version there spans `trigger_parameter_sync_step x require_batches x ppo_mini_batch_size`
prompts, one optimizer update per `ppo_mini_batch_size`, and `staleness_threshold` is the share of
the next version's samples the rollout may generate ahead. Here one step is one weight version: its
prompts are that product, its updates are `actor.sequences_per_update` apart as before, and the
threshold is `rollout.max_staleness` (a fraction admits that share of the next step's groups early).
"""

from __future__ import annotations

from typing import Any

from hybridflow.config.verl_rules import truthy

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


def disaggregated(
    verl: dict[str, Any], ours: set[str] = frozenset()
) -> tuple[list[tuple[str, Any]], list[str], list[str]]:
    """(our settings, notes, problems) from the verl keys given (recipe and command, later wins) and
    the names of our own keys given beside them."""
    hybrid = truthy(verl.get(f"{ARR}.hybrid_engine", True))
    gpus = verl.get("rollout.n_gpus_per_node")
    given = {k.split(".", 1)[1]: v for k, v in verl.items() if k.startswith("async_training.")}
    if f"{ARR}.actor.use_rollout_log_probs" in verl:
        given.setdefault("use_rollout_log_probs", verl[f"{ARR}.actor.use_rollout_log_probs"])
    fully_async = any(k.startswith("async_training.") for k in verl)
    if hybrid:
        if gpus is not None:
            return (
                [],
                [],
                [
                    f"rollout.n_gpus_per_node={gpus} gives the engine GPUs of its own: set "
                    f"{ARR}.hybrid_engine=False as verl's recipes do"
                ],
            )
        if not fully_async:
            return [], [], []
        settings = []
        notes = [
            "async_training.*: the engine shares the trainer's GPU (hybrid_engine=True), generating beside it"
        ]
    else:
        if gpus is None:
            return (
                [],
                [],
                [
                    f"{ARR}.hybrid_engine=False: give the engine GPUs of its own with rollout.n_gpus_per_node "
                    "(and rollout.nnodes), as verl's recipes do, or resources.rollout_workers=N"
                ],
            )
        mixed = [k for k in RESOURCE_KEYS if k in ours]
        if mixed:  # verl's GPU counts would silently replace them
            return (
                [],
                [],
                [
                    f"{', '.join(mixed)} beside verl's rollout.n_gpus_per_node: give the GPUs one way, verl's "
                    "trainer.* / rollout.* counts or our resources.*"
                ],
            )
        settings, problems = _workers(verl, int(gpus), int(verl.get("rollout.nnodes", 1)))
        if problems:
            return [], [], problems
        workers = settings[-1][1]
        if not fully_async:
            return (
                [*settings, ("trainer.async_mode", "one_step")],
                [
                    f"verl's one_step_off_policy: {workers} rollout worker(s) generate step k+1 while the "
                    "trainer trains on step k (trainer.async_mode=one_step)"
                ],
                [],
            )
        notes = []
    return _fully_async(verl, {**ASYNC_DEFAULTS, **given}, settings, notes)


def _workers(verl, r_gpus: int, r_nodes: int) -> tuple[list[tuple[str, Any]], list[str]]:
    """verl counts the trainer's GPUs (trainer.*) and the rollout's (rollout.*) apart; here
    resources.n_gpus_per_node x nnodes counts all workers, the last resources.rollout_workers of them
    the rollout's."""
    t_gpus, t_nodes = int(verl.get("trainer.n_gpus_per_node", 1)), int(verl.get("trainer.nnodes", 1))
    if t_nodes == 1 and r_nodes == 1:  # one node holds both, as in verl's single-node scripts
        per_node, nodes = t_gpus + r_gpus, 1
    elif t_gpus == r_gpus:  # whole nodes each
        per_node, nodes = t_gpus, t_nodes + r_nodes
    else:
        return [], [
            f"trainer {t_nodes} x {t_gpus} GPUs and rollout {r_nodes} x {r_gpus} GPUs do not make whole nodes "
            "of one size: set resources.n_gpus_per_node, resources.nnodes and resources.rollout_workers"
        ]
    return [
        ("resources.n_gpus_per_node", per_node),
        ("resources.nnodes", nodes),
        ("resources.rollout_workers", r_gpus * r_nodes),
    ], []


def _fully_async(verl, a, settings, notes):
    problems = []
    threshold = float(a["staleness_threshold"])
    partial = truthy(a["partial_rollout"])
    mini = int(verl.get(f"{ARR}.actor.ppo_mini_batch_size", VERL_MINI_BATCH))
    prompts = int(a["trigger_parameter_sync_step"]) * int(a["require_batches"]) * mini
    if threshold < 0:
        problems.append(f"async_training.staleness_threshold={threshold} must be >= 0")
    if not partial and threshold > 1:
        problems.append(
            f"async_training.partial_rollout=False with staleness_threshold={threshold}: without partial "
            "rollouts a weight update waits for the groups in flight, which bounds staleness at 1; "
            "use partial_rollout=True or a threshold <= 1"
        )
    settings += [
        ("trainer.async_mode", "streaming" if partial else "one_step"),
        ("rollout.max_staleness", threshold),
        ("data.prompts_per_step", prompts),
        # verl's default: pi_old is the rollout's own log-probs; compute_prox_log_prob recomputes it
        (
            "algorithm.rollout_correction.bypass_mode",
            truthy(a["use_rollout_log_probs"]) and not truthy(a["compute_prox_log_prob"]),
        ),
    ]
    notes.append(
        f"verl's fully_async_policy: a step is one weight version of trigger_parameter_sync_step x "
        f"require_batches x ppo_mini_batch_size = {prompts} prompts (data.prompts_per_step; "
        f"data.train_batch_size does not count, as in verl), rollout.max_staleness={threshold}, "
        f"trainer.async_mode={'streaming' if partial else 'one_step'}"
    )
    total = verl.get("rollout.total_rollout_steps")
    if total is not None:
        steps = int(total) // prompts
        if steps < 1:
            problems.append(
                f"rollout.total_rollout_steps={total} is fewer prompts than one weight version ({prompts})"
            )
        settings.append(("trainer.total_training_steps", steps))
        if int(total) % prompts:
            notes.append(
                f"rollout.total_rollout_steps={total} is {steps} steps of {prompts} prompts; the last "
                f"{int(total) % prompts} are not generated"
            )
    return settings, notes, problems
