"""Config dataclasses of the Python API: flat keyword fields for the common knobs, the YAML config's
sections (as nested mappings) for everything else, and one preset per algorithm.

    GRPOConfig(output_dir="runs/x", prompts_per_step=8, learning_rate=1e-6,
               actor={"clip_ratio_high": 0.28}, overrides=["trainer.save_freq=50"])

Precedence, later wins: defaults <- `recipe` <- the class's preset <- the sections <- the flat fields
<- `overrides` (dot-list strings, as on the command line).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybridflow.api.trl_config import trl_settings, unknown_names
from hybridflow.config import Config, load_config
from hybridflow.errors import UserError

SECTIONS = (
    "model",
    "data",
    "rollout",
    "actor",
    "ref",
    "critic",
    "reward",
    "algorithm",
    "trainer",
    "resources",
)


class _NamesChecked(type):
    """Keywords a config class does not take are refused in one message naming what to use instead
    (TRL's names that mean something else here, or the closest field), not a bare TypeError."""

    def __call__(cls, *args, **kwargs):
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in kwargs if k not in fields]
        if unknown:
            raise UserError(unknown_names(cls.__name__, unknown, fields))
        return super().__call__(*args, **kwargs)


@dataclass
class RLConfig(metaclass=_NamesChecked):
    """What every algorithm shares. A flat field left at None keeps the preset's (or recipe's) value."""

    output_dir: str | None = None
    """The run directory (trainer.run_dir): metrics, checkpoints, the report."""
    prompts_per_step: int | None = None
    samples_per_prompt: int | None = None
    max_prompt_tokens: int | None = None
    max_response_tokens: int | None = None
    learning_rate: float | None = None
    kl_coef: float | None = None
    """Weight of the KL to the reference policy; 0 turns it off (each preset says where it applies)."""
    lora_rank: int | None = None
    """> 0 trains LoRA adapters of this rank instead of all weights (model.lora_rank)."""
    max_steps: int | None = None
    seed: int | None = None
    recipe: str | None = None
    """A built-in recipe name or YAML path to start from."""
    model: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    rollout: dict[str, Any] = field(default_factory=dict)
    actor: dict[str, Any] = field(default_factory=dict)
    ref: dict[str, Any] = field(default_factory=dict)
    critic: dict[str, Any] = field(default_factory=dict)
    reward: dict[str, Any] = field(default_factory=dict)
    algorithm: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)

    # TRL's names (GRPOConfig, and the tutorials' PPOConfig), converted by api/trl_config.py; each
    # means what it means in TRL, or the config says why not. None: not given.
    num_generations: int | None = None
    max_completion_length: int | None = None
    max_prompt_length: int | None = None
    beta: float | None = None
    epsilon: float | None = None
    epsilon_high: float | None = None
    num_train_epochs: float | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    num_iterations: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    loss_type: str | None = None
    scale_rewards: str | bool | None = None
    reward_weights: list[float] | None = None
    save_steps: int | None = None
    logging_steps: int | None = None
    eval_steps: int | None = None
    lr_scheduler_type: str | None = None
    warmup_ratio: float | None = None
    warmup_steps: int | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    adam_beta1: float | None = None
    adam_beta2: float | None = None
    gradient_checkpointing: bool | None = None
    report_to: str | list[str] | None = None
    use_vllm: bool | None = None
    bf16: bool | None = None
    mask_truncated_completions: bool | None = None
    importance_sampling_level: str | None = None
    shuffle_dataset: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    log_completions: bool | None = None
    remove_unused_columns: bool | None = None
    exp_name: str | None = None
    batch_size: int | None = None
    mini_batch_size: int | None = None
    ppo_epochs: int | None = None
    cliprange: float | None = None
    cliprange_value: float | None = None
    vf_coef: float | None = None
    max_new_tokens: int | None = None
    save_freq: int | None = None
    gamma: float | None = None
    lam: float | None = None

    PRESET: ClassVar[dict[str, Any]] = {}
    notes: ClassVar[list[str]] = []
    KL_IN_REWARD: ClassVar[bool] = False
    """Where kl_coef goes: a KL penalty in the reward (PPO) or a KL loss on the actor (GRPO family)."""
    TRL_DEFAULTS: ClassVar[dict[str, Any]] = {}
    """For the classes named as TRL's (GRPOConfig, RLOOConfig): TRL's defaults (trl 1.16) for what
    the caller leaves unset, with no recipe given; see `trl_default_settings`."""

    def settings(self) -> dict[str, Any]:
        """The nested settings: the preset (and TRL's defaults), then the sections, then the flat fields."""
        tree: dict[str, Any] = {}
        _merge(tree, self.PRESET)
        trl_default_notes = []
        if self.TRL_DEFAULTS and self.recipe is None:
            defaults, trl_default_notes = trl_default_settings(self)
            _merge(tree, defaults)
        _merge(tree, {name: getattr(self, name) for name in SECTIONS if getattr(self, name)})
        flat = {
            "trainer.run_dir": self.output_dir,
            "data.prompts_per_step": self.prompts_per_step,
            "rollout.samples_per_prompt": self.samples_per_prompt,
            "data.max_prompt_tokens": self.max_prompt_tokens,
            "data.max_response_tokens": self.max_response_tokens,
            "actor.optim.lr": self.learning_rate,
            "model.lora_rank": self.lora_rank,
            "trainer.total_training_steps": self.max_steps,
            "trainer.seed": self.seed,
        }
        kl_coef = self.kl_coef if self.kl_coef is not None else self.beta  # beta: TRL's name
        if kl_coef is not None:
            on = kl_coef > 0
            if self.KL_IN_REWARD:
                flat |= {"algorithm.use_kl_in_reward": on, "algorithm.kl_ctrl.kl_coef": kl_coef}
            else:
                flat |= {"actor.use_kl_loss": on, "actor.kl_loss_coef": kl_coef}
        for key, value in flat.items():
            if value is not None:
                _merge(tree, _nest(key, value))
        self._check_one_name_each()
        samples = (
            _dig(tree, "rollout.samples_per_prompt") or _dig(self.PRESET, "rollout.samples_per_prompt") or 4
        )
        trl, notes = trl_settings(self, samples)
        self.notes = [*trl_default_notes, *notes]
        for key, value in trl.items():
            _merge(tree, _nest(key, value))
        return tree

    def _check_one_name_each(self) -> None:
        for ours, theirs in (
            ("samples_per_prompt", "num_generations"),
            ("max_response_tokens", "max_completion_length"),
            ("max_response_tokens", "max_new_tokens"),
            ("max_prompt_tokens", "max_prompt_length"),
            ("kl_coef", "beta"),
            ("prompts_per_step", "batch_size"),
            ("prompts_per_step", "per_device_train_batch_size"),
            ("prompts_per_step", "generation_batch_size"),
        ):
            if getattr(self, ours) is not None and getattr(self, theirs) is not None:
                raise UserError(f"{ours}= and TRL's {theirs}= both given: give one of them")

    def to_config(self) -> Config:
        return load_config(self.recipe, self.overrides, settings=self.settings())


# TRL's fields and ours that say the same thing: a default of TRL's applies only when none is given
_TWINS = {
    "num_generations": ("samples_per_prompt",),
    "per_device_train_batch_size": (
        "prompts_per_step", "batch_size", "generation_batch_size", "steps_per_generation",
        "gradient_accumulation_steps",
    ),
    "max_completion_length": ("max_response_tokens", "max_new_tokens"),
    "beta": ("kl_coef",),
}  # fmt: skip
# how each TRL default reads in our keys (the KL term is the class's own: see trl_default_settings)
_TRL_KEYS = {
    "max_completion_length": "data.max_response_tokens",
    "learning_rate": "actor.optim.lr",
    "num_train_epochs": "trainer.total_epochs",
    "temperature": "rollout.temperature",
    "top_p": "rollout.top_p",
    "weight_decay": "actor.optim.weight_decay",
    "max_grad_norm": "actor.optim.grad_clip",
    "warmup_ratio": "actor.optim.warmup_ratio",
    "num_iterations": "actor.ppo_epochs",
    "shuffle_dataset": "data.shuffle",
}
# where hybridflow keeps its own default on purpose (said at start)
DELIBERATE = (
    "bf16 (TRL: on where supported): hybridflow computes in actor.compute_dtype, the device's fast dtype "
    "(float32 on CPU); gradient_checkpointing (TRL: on): off unless asked, it changes memory, not results; "
    "logging_steps (TRL: 10): every step is logged"
)


def trl_default_settings(args: RLConfig) -> tuple[dict[str, Any], list[str]]:
    """TRL's defaults as a settings tree, for every TRL field that `args` leaves unset (its sections
    and flat fields, merged later, still win), and the note that says where hybridflow differs."""
    d = args.TRL_DEFAULTS

    def unset(name: str) -> bool:
        return getattr(args, name) is None and all(getattr(args, t) is None for t in _TWINS.get(name, ()))

    tree: dict[str, Any] = {}
    for name, key in _TRL_KEYS.items():
        if name in d and unset(name):
            _merge(tree, _nest(key, d[name]))
    if unset("num_generations"):
        _merge(tree, _nest("rollout.samples_per_prompt", d["num_generations"]))
    samples = (
        args.num_generations
        or args.samples_per_prompt
        or _dig(args.rollout, "samples_per_prompt")
        or d["num_generations"]
    )
    if unset("per_device_train_batch_size") and _dig(args.data, "prompts_per_step") is None:
        # one optimizer update per generation of per_device_train_batch_size completions (one device)
        _merge(tree, _nest("data.prompts_per_step", max(1, d["per_device_train_batch_size"] // samples)))
    if unset("epsilon"):
        _merge(tree, {"actor": {"clip_ratio_low": d["epsilon"], "clip_ratio_high": d["epsilon"]}})
    if unset("top_k"):
        _merge(tree, _nest("rollout.top_k", -1))  # TRL's 0: no top-k
    if unset("lr_scheduler_type"):
        _merge(tree, _nest("actor.optim.lr_scheduler", "linear"))  # transformers' default
    if unset("adam_beta1") and unset("adam_beta2"):
        _merge(tree, _nest("actor.optim.betas", [0.9, 0.999]))
    if unset("loss_type") and "loss_agg_mode" in d:
        _merge(tree, _nest("actor.loss_agg_mode", d["loss_agg_mode"]))
    if unset("scale_rewards") and "scale_rewards" in d:
        _merge(tree, _nest("algorithm.norm_adv_by_std_in_grpo", d["scale_rewards"] == "group"))
    if unset("beta"):
        beta = d["beta"]
        if args.KL_IN_REWARD:
            kl = {
                "use_kl_in_reward": beta > 0,
                "kl_penalty": "kl",
                "kl_ctrl": {"type": "fixed", "kl_coef": beta},
            }
            _merge(tree, {"algorithm": kl})
        else:
            _merge(tree, {"actor": {"use_kl_loss": beta > 0, "kl_loss_coef": beta}})
    return tree, [f"{type(args).__name__} starts from TRL's defaults, except {DELIBERATE}"]


def _dig(tree: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _nest(key: str, value: Any) -> dict[str, Any]:
    *parents, leaf = key.split(".")
    tree: dict[str, Any] = {leaf: value}
    for p in reversed(parents):
        tree = {p: tree}
    return tree


def _merge(into: dict[str, Any], tree: dict[str, Any]) -> None:
    for k, v in tree.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:  # a copy: a later merge must never write into a preset or the caller's sections
            into[k] = copy.deepcopy(v)


_TRL_COMMON = {
    "learning_rate": 1e-6, "max_completion_length": 512, "num_train_epochs": 3, "temperature": 1.0,
    "top_p": 1.0, "per_device_train_batch_size": 8, "num_iterations": 1, "epsilon": 0.2,
    "weight_decay": 0.0, "max_grad_norm": 1.0, "warmup_ratio": 0.0, "shuffle_dataset": True,
}  # fmt: skip


@dataclass
class GRPOConfig(RLConfig):
    """GRPO (Shao et al. 2024): group-normalised advantages, no critic. What is left unset takes TRL's
    GRPOConfig defaults (8 generations, 8 completions a step, beta 0, loss_type dapo = token-mean,
    3 epochs, 512 completion tokens), unless a recipe is given."""

    PRESET: ClassVar[dict[str, Any]] = {"algorithm": {"adv_estimator": "grpo"}}
    TRL_DEFAULTS: ClassVar[dict[str, Any]] = {
        **_TRL_COMMON, "num_generations": 8, "beta": 0.0, "loss_agg_mode": "token-mean", "scale_rewards": "group",
    }  # fmt: skip


@dataclass
class PPOConfig(RLConfig):
    """PPO with a critic (GAE), one sample per prompt, a KL penalty in the reward (kl_coef, 0.001)."""

    PRESET: ClassVar[dict[str, Any]] = {
        "algorithm": {"adv_estimator": "gae", "use_kl_in_reward": True, "kl_ctrl": {"kl_coef": 0.001}},
        "rollout": {"samples_per_prompt": 1},
    }
    KL_IN_REWARD: ClassVar[bool] = True


@dataclass
class DAPOConfig(RLConfig):
    """DAPO (Yu et al. 2025): clip-higher (0.2/0.28), token-mean loss, dynamic sampling (groups whose
    samples all score alike are resampled) and overlong reward shaping over the last quarter of
    max_response_tokens (unless reward.overlong_buffer says otherwise)."""

    PRESET: ClassVar[dict[str, Any]] = {
        "algorithm": {"adv_estimator": "grpo", "filter_groups": {"enable": True}},
        "actor": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "loss_agg_mode": "token-mean"},
        "reward": {"overlong_buffer": {"enable": True}},
    }

    def to_config(self) -> Config:
        config = super().to_config()
        buffer = config.reward.overlong_buffer
        if buffer.enable and "buffer_tokens" not in self.reward.get("overlong_buffer", {}):
            buffer.buffer_tokens = max(1, config.data.max_response_tokens // 4)
        return config


@dataclass
class RLOOConfig(RLConfig):
    """RLOO (Ahmadian et al. 2024): each sample's baseline is the mean of the others in its group. As
    in TRL's RLOOTrainer, `beta` (kl_coef) is a KL penalty subtracted from each sequence's reward
    (k1, summed over its tokens) before the baseline, not a loss term; what is left unset takes TRL's
    RLOOConfig defaults (2 generations, 8 completions a step, beta 0.05, 3 epochs), and the loss sums
    each sequence's tokens (TRL's sequence-level ratio, equal on-policy), unless a recipe is given."""

    PRESET: ClassVar[dict[str, Any]] = {"algorithm": {"adv_estimator": "rloo"}}
    KL_IN_REWARD: ClassVar[bool] = True
    TRL_DEFAULTS: ClassVar[dict[str, Any]] = {
        **_TRL_COMMON, "num_generations": 2, "beta": 0.05, "loss_agg_mode": "seq-mean-token-sum",
    }  # fmt: skip


@dataclass
class ReinforcePPConfig(RLConfig):
    """REINFORCE++ (Hu 2025): returns normalised over the whole batch, a token-level KL penalty in the
    reward (kl_coef, 0.001)."""

    PRESET: ClassVar[dict[str, Any]] = {
        "algorithm": {
            "adv_estimator": "reinforce_plus_plus",
            "use_kl_in_reward": True,
            "kl_ctrl": {"kl_coef": 0.001},
        }
    }
    KL_IN_REWARD: ClassVar[bool] = True
