"""Which features combine. Every pair of features that does not work together yet is one row of
`REFUSED`, with the reason and the way out; `refuse_incompatible(config, workers)` stops a run that
holds such a pair with that one line (the start checks and `hybridflow plan` call it), and
docs/compatibility.md prints the table (`markdown()`; a test keeps the page equal to it and builds
every pair from its features' example settings to check that the code refuses exactly these).

A pair that is not in the table is meant to work; a refusal of a pair written anywhere else is a
refusal users cannot read about. Checks of one setting's value (a bound, a divisibility, a model
that lacks what a feature needs) stay where the value is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hybridflow.algorithms.estimators import estimator
from hybridflow.config import Config
from hybridflow.errors import UserError


@dataclass(frozen=True)
class Feature:
    label: str
    """What users call it."""
    setting: str
    """How it is turned on, for the docs."""
    on: Callable[[Config, int], bool]
    """Whether `config` (run on `workers` training workers) uses it."""
    shown: Callable[[Config], str]
    """The setting as this config has it, for the one-line refusal."""
    example: tuple[str, ...]
    """Overrides that turn it on (the table's test builds every pair from them)."""


def _lora(c: Config) -> bool:
    return bool(c.model.lora_rank or c.model.lora_adapter_path)


def _own_reference(c: Config) -> bool:
    """The reference is a model of its own (not the policy's base with LoRA's adapters off)."""
    return (c.actor.use_kl_loss or c.algorithm.use_kl_in_reward) and not (_lora(c) and not c.ref.model_path)


FEATURES: dict[str, Feature] = {
    "async": Feature(
        "asynchronous training", "trainer.async_mode=one_step | streaming",
        lambda c, w: c.trainer.async_mode != "off", lambda c: f"trainer.async_mode={c.trainer.async_mode}",
        ("trainer.async_mode=one_step",),
    ),
    "workers": Feature(
        "several training workers (FSDP2)", "resources.num_workers | trainer.n_gpus_per_node > 1",
        lambda c, w: w > 1, lambda c: "several training workers",
        ("resources.device=cpu", "resources.num_workers=2"),
    ),
    "rollout_tp": Feature(
        "an engine split over workers (tensor parallel)", "rollout.tensor_parallel_size > 1",
        lambda c, w: c.rollout.tensor_parallel_size > 1,
        lambda c: f"rollout.tensor_parallel_size={c.rollout.tensor_parallel_size}",
        ("rollout.tensor_parallel_size=2", "resources.device=cpu", "resources.num_workers=2"),
    ),
    "hf_backend": Feature(
        "generation by transformers or vLLM", "rollout.backend=hf | vllm",
        lambda c, w: c.rollout.backend in ("hf", "vllm"), lambda c: f"rollout.backend={c.rollout.backend}",
        ("rollout.backend=hf",),
    ),
    "server": Feature(
        "the policy served over HTTP while it trains", "rollout.server=true",
        lambda c, w: c.rollout.server, lambda c: "rollout.server=true", ("rollout.server=true",),
    ),
    "dapo": Feature(
        "DAPO's dynamic sampling", "algorithm.filter_groups.enable=true",
        lambda c, w: c.algorithm.filter_groups.enable, lambda c: "algorithm.filter_groups.enable=true",
        ("algorithm.filter_groups.enable=true",),
    ),
    "greedy_baseline": Feature(
        "a greedy-baseline estimator (ReMax)", "algorithm.adv_estimator=remax",
        lambda c, w: estimator(c.algorithm.adv_estimator).needs_greedy_baseline,
        lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator}", ("algorithm.adv_estimator=remax",),
    ),
    "lora": Feature(
        "LoRA", "model.lora_rank > 0 | model.lora_adapter_path", lambda c, w: _lora(c),
        lambda c: f"model.lora_rank={c.model.lora_rank}" if c.model.lora_rank else "model.lora_adapter_path",
        ("model.lora_rank=4",),
    ),
    "offload": Feature(
        "weights in CPU memory", "actor.offload_params=true | ref.offload_params=true (a reference of its own)",
        lambda c, w: c.actor.offload_params or (c.ref.offload_params and _own_reference(c)),
        lambda c: "actor.offload_params=true" if c.actor.offload_params else "ref.offload_params=true",
        ("actor.offload_params=true",),
    ),
    "rollout_workers": Feature(
        "rollout workers (the engine on devices of its own)", "resources.rollout_workers > 0",
        lambda c, w: c.resources.rollout_workers > 0,
        lambda c: f"resources.rollout_workers={c.resources.rollout_workers}", ("resources.rollout_workers=1",),
    ),
    "pause": Feature(
        "an engine that pauses for the trainer", "rollout.pause_for_training=true",
        lambda c, w: bool(c.rollout.pause_for_training), lambda c: "rollout.pause_for_training=true",
        ("trainer.async_mode=streaming", "rollout.pause_for_training=true"),
    ),
    "agent": Feature(
        "agent loops (tools, environments)", "rollout.agent.loop=tools | environment",
        lambda c, w: bool(c.rollout.agent.loop), lambda c: f"rollout.agent.loop={c.rollout.agent.loop}",
        ("rollout.agent.loop=tools", "rollout.agent.tools=[calculator]"),
    ),
    "environment": Feature(
        "an environment's rewards", "rollout.agent.loop=environment",
        lambda c, w: c.rollout.agent.loop == "environment", lambda c: "rollout.agent.loop=environment",
        ("rollout.agent.loop=environment", "rollout.agent.environment=guess_number"),
    ),
    "custom_reward": Feature(
        "a reward function of your own", "reward.custom_function_path",
        lambda c, w: c.reward.custom_function_path is not None,
        lambda c: f"reward.custom_function_path={c.reward.custom_function_path}",
        ("reward.custom_function_path=reward.py",),
    ),
    "r3": Feature(
        "router replay of the sampler's routes", "actor.router_replay=R3",
        lambda c, w: c.actor.router_replay == "R3", lambda c: "actor.router_replay=R3", ("actor.router_replay=R3",),
    ),
    "r2": Feature(
        "router replay of the old-log-prob pass", "actor.router_replay=R2",
        lambda c, w: c.actor.router_replay == "R2", lambda c: "actor.router_replay=R2", ("actor.router_replay=R2",),
    ),
    "bypass": Feature(
        "the sampler's log-probs as pi_old (bypass mode)", "algorithm.rollout_correction.bypass_mode=true",
        lambda c, w: c.algorithm.rollout_correction.bypass_mode,
        lambda c: "algorithm.rollout_correction.bypass_mode=true", ("algorithm.rollout_correction.bypass_mode=true",),
    ),
    "sp": Feature(
        "sequence parallelism (Ulysses)", "actor.sequence_parallel_size > 1",
        lambda c, w: c.actor.sequence_parallel_size > 1,
        lambda c: f"actor.sequence_parallel_size={c.actor.sequence_parallel_size}",
        ("actor.sequence_parallel_size=2", "resources.device=cpu", "resources.num_workers=2"),
    ),
    "tp": Feature(
        "tensor parallelism in training", "actor.tensor_parallel_size > 1",
        lambda c, w: c.actor.tensor_parallel_size > 1,
        lambda c: f"actor.tensor_parallel_size={c.actor.tensor_parallel_size}",
        ("actor.tensor_parallel_size=2", "resources.device=cpu", "resources.num_workers=2"),
    ),
    "exact": Feature(
        "exact rollout log-probs", "rollout.exact_logprobs=true",
        lambda c, w: c.rollout.exact_logprobs, lambda c: "rollout.exact_logprobs=true",
        ("rollout.exact_logprobs=true",),
    ),
    "speculative": Feature(
        "speculative decoding from the run's history", "rollout.speculative.num_speculative_tokens > 0",
        lambda c, w: c.rollout.speculative.num_speculative_tokens > 0,
        lambda c: f"rollout.speculative.num_speculative_tokens={c.rollout.speculative.num_speculative_tokens}",
        ("rollout.speculative.num_speculative_tokens=4",),
    ),
    "ep": Feature(
        "expert parallelism", "actor.expert_parallel_size > 1",
        lambda c, w: c.actor.expert_parallel_size > 1,
        lambda c: f"actor.expert_parallel_size={c.actor.expert_parallel_size}",
        ("actor.expert_parallel_size=2", "resources.device=cpu", "resources.num_workers=2"),
    ),
}  # fmt: skip

# (feature, feature) -> why they do not combine yet, and what to do: one line each
REFUSED: dict[tuple[str, str], str] = {
    ("async", "rollout_tp"): "is not built for an engine split over workers (its ranks would have to admit the same "
    "groups between the same steps): use rollout.tensor_parallel_size=1, or trainer.async_mode=off",
    ("async", "hf_backend"): "generates with the built-in engine, not transformers' or vLLM's: use "
    "rollout.backend=native, or trainer.async_mode=off",
    ("async", "server"): "drives the engine itself, not through rollout.server: use trainer.async_mode=off",
    ("rollout_workers", "hf_backend"): "rollout workers run the built-in engine, which receives the weights "
    "there; transformers' or vLLM's cannot: use rollout.backend=native",
    ("pause", "rollout_workers"): "pausing shares one device between engine and trainer; rollout workers have "
    "devices of their own: drop rollout.pause_for_training",
    ("agent", "hf_backend"): "agent loops run their episodes on the built-in engine: set rollout.backend=native",
    ("environment", "custom_reward"): "the environment's rewards score every episode, so the function would "
    "never be called: remove reward.custom_function_path",
    ("r3", "hf_backend"): "R3 needs the experts our engine records (rollout.backend=native, model.impl=native)",
    ("r3", "agent"): "R3 with agent loops is not built (an episode's turns are several engine requests whose "
    "routes are not joined yet): set actor.router_replay=disabled",
    ("r3", "sp"): "R3 does not split its routes for actor.sequence_parallel_size > 1 yet: set one of them back",
    ("r2", "bypass"): "R2 replays the routing of the old-log-prob pass, which bypass_mode=true skips (pi_old is "
    "the sampler's): use R3, which replays the sampler's own routing, or turn bypass mode off",
    ("r2", "sp"): "R2 does not split its routes for actor.sequence_parallel_size > 1 yet: set one of them back",
    ("tp", "sp"): "tensor parallelism does not combine with sequence parallelism yet: set one of them to 1",
    ("tp", "offload"): "tensor parallelism does not combine with offload_params yet: drop one of them",
    ("exact", "lora"): "the exact kernels do not cover LoRA's adapters yet (the engine runs merged weights): "
    "train the full model, or set rollout.exact_logprobs=false",
    ("exact", "hf_backend"): "exact log-probs come from the built-in engine's kernels: set rollout.backend=native",
    ("exact", "rollout_tp"): "the exact kernels do not cover an engine split over workers yet: use "
    "rollout.tensor_parallel_size=1, or rollout.exact_logprobs=false",
    ("exact", "tp"): "the exact kernels do not cover tensor-parallel training yet: set actor.tensor_parallel_size=1, "
    "or rollout.exact_logprobs=false",
    ("exact", "sp"): "the exact kernels do not cover sequence parallelism yet: set actor.sequence_parallel_size=1, "
    "or rollout.exact_logprobs=false",
    ("exact", "ep"): "the exact kernels do not cover mixture-of-experts layers yet: set rollout.exact_logprobs=false",
    ("speculative", "hf_backend"): "drafts are checked by the built-in engine: set rollout.backend=native, or "
    "rollout.speculative.num_speculative_tokens=0",
    ("speculative", "rollout_tp"): "speculative steps are not built for an engine split over workers yet: use "
    "rollout.tensor_parallel_size=1, or rollout.speculative.num_speculative_tokens=0",
    ("ep", "tp"): "tensor parallelism already splits the experts over its ranks: set one of the two",
    ("ep", "sp"): "expert parallelism does not combine with sequence parallelism yet: set one of them to 1",
    ("ep", "offload"): "expert parallelism does not combine with offload_params yet (the experts would stay on "
    "the GPU): drop one of them",
}  # fmt: skip


def refused_pairs(config: Config, workers: int) -> list[tuple[str, str]]:
    """The pairs of REFUSED that `config` (on `workers` training workers) holds, in the table's order."""
    on = {name: f.on(config, workers) for name, f in FEATURES.items()}
    return [pair for pair in REFUSED if on[pair[0]] and on[pair[1]]]


def refuse_incompatible(config: Config, workers: int) -> None:
    """One line for the first refused pair `config` holds (see docs/compatibility.md)."""
    pairs = refused_pairs(config, workers)
    if pairs:
        a, b = pairs[0]
        shown = f"{FEATURES[a].shown(config)} with {FEATURES[b].shown(config)}"
        raise UserError(f"{shown}: {REFUSED[a, b]} (docs/compatibility.md)")


def markdown() -> str:
    """docs/compatibility.md's tables (a test checks that the page holds them as rendered here)."""
    rows = [
        f"{len(REFUSED)} pairs of features do not combine yet; every other pair is meant to work.",
        "",
        "| feature | turned on by |",
        "| --- | --- |",
        *(f"| {f.label} | `{f.setting}` |" for f in FEATURES.values()),
        "",
        "| with | refused: why, and what to do |",
        "| --- | --- |",
        *(f"| {FEATURES[a].label} + {FEATURES[b].label} | {why} |" for (a, b), why in REFUSED.items()),
    ]
    return "\n".join(rows)
