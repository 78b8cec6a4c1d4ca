"""Trainer classes in the style TRL users know, thin presets over `RLTrainer`:

    trainer = GRPOTrainer(actor_model=model, tokenizer=tokenizer, train_dataset=dataset,
                          reward_fn=lambda prompts, responses, **columns: [...],
                          args=GRPOConfig(output_dir="runs/x", prompts_per_step=8))
    trainer.train(max_steps=100)
    trainer.evaluate()
    trainer.save("my-model")        # a transformers directory, verified by reloading it

Models, tokenizer and datasets may be paths or live objects; live ones are written under the run's
`inputs/` folder (the trainer's workers load from disk, in this process or others). Switching
algorithm is switching the class.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow import run_manifest
from hybridflow.algorithms.estimators import estimator
from hybridflow.api.configs import DAPOConfig, GRPOConfig, PPOConfig, ReinforcePPConfig, RLConfig, RLOOConfig
from hybridflow.api.inputs import INPUTS, dataset_rows, is_path, is_verl_reward, with_rows_kept, write_model
from hybridflow.api.trl_rewards import TRLRewards, keyword_callable
from hybridflow.config import Config
from hybridflow.data.files import write_rows
from hybridflow.errors import UserError


class Trainer:
    """Base of the algorithm classes; `CONFIG` is the config class `args` defaults to."""

    CONFIG: type[RLConfig] = RLConfig

    def __init__(
        self,
        actor_model: Any = None,
        *,
        args: RLConfig | Config | None = None,
        tokenizer: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        reward_fn: Callable | str | list | None = None,
        ref_model: Any = None,
        critic_model: Any = None,
        overwrite: bool = False,
        model: Any = None,
        reward_funcs: Callable | str | list | None = None,
        processing_class: Any = None,
        dataset: Any = None,
        config: RLConfig | Config | None = None,
        peft_config: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
    ) -> None:
        """`actor_model`: an `AutoModelForCausalLM`, an HF directory, a .gguf file or "default".
        `train_dataset`/`eval_dataset`: a `datasets.Dataset`, a list of row dicts, or data file
        path(s); None keeps the config's data files or task. `reward_fn`: TRL-style
        `fn(prompts, responses, **columns) -> list[float]`, verl's `compute_score(data_source,
        solution_str, ground_truth, extra_info)` (or its batched form), or a path to a Python file
        defining `compute_score`; None scores with the built-in scorer of each row's data_source.
        `ref_model` (KL reference) and `critic_model` (PPO): a model or path; None derives them from
        the actor. `overwrite` starts over in a run directory holding an earlier run.

        TRL's names are accepted for the same things: `model` (actor_model), `reward_funcs` (a
        function, a list of them weighted by the config's `reward_weights`, or a reward model
        directory), `processing_class` (tokenizer), and the tutorials' `dataset` (train_dataset) and
        `config` (args). `peft_config` (a peft.LoraConfig) sets model.lora_rank/alpha/target_modules.
        TRL's `reward_processing_classes` are accepted (a reward model renders its inputs with the
        tokenizer saved in its directory: said at start); `callbacks` and `optimizers` are refused
        with what to use instead."""
        from hybridflow.offline.base import refuse_their_arguments

        refuse_their_arguments(type(self).__name__, {"callbacks": callbacks, "optimizers": optimizers})
        actor_model = _one_of("actor_model", actor_model, "model", model, default="default")
        reward_fn = _one_of("reward_fn", reward_fn, "reward_funcs", reward_funcs)
        tokenizer = _one_of("tokenizer", tokenizer, "processing_class", processing_class)
        train_dataset = _one_of("train_dataset", train_dataset, "dataset", dataset)
        args = _one_of("args", args, "config", config)
        args = args if args is not None else self.CONFIG()
        if isinstance(args, RLConfig) and type(args) is not self.CONFIG:  # the class picks the algorithm
            args = self.CONFIG(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
        self.config = c = args.to_config() if isinstance(args, RLConfig) else copy.deepcopy(args)
        for note in getattr(args, "notes", []):
            print(f"note: {note}", flush=True)
        given = (
            reward_processing_classes
            if isinstance(reward_processing_classes, (list, tuple))
            else [reward_processing_classes]
        )
        if any(p is not None for p in given):
            print("note: reward_processing_classes: a reward model renders its inputs with the tokenizer and "
                  "chat template saved in its own directory; the given ones are not used", flush=True)  # fmt: skip
        if peft_config is not None:
            _apply_peft_config(c, peft_config)
        self.overwrite = overwrite
        self._rl = None
        inputs = Path(c.trainer.run_dir) / INPUTS
        self._writes: list[Callable[[], None]] = []

        if not is_path(actor_model) or tokenizer is not None:
            tokenizer = _tokenizer_of(actor_model) if tokenizer is None else _load_tokenizer(tokenizer)
            self._write(
                inputs / "actor", lambda m=actor_model, t=tokenizer: write_model(m, t, inputs / "actor")
            )
            c.model.path = str(inputs / "actor")
        else:
            c.model.path = str(actor_model)
        if ref_model is not None and not (c.actor.use_kl_loss or c.algorithm.use_kl_in_reward):
            raise UserError("ref_model is the KL term's reference, and no KL term is on: set kl_coef > 0")
        if critic_model is not None and not estimator(c.algorithm.adv_estimator).needs_critic:
            raise UserError(f"critic_model is for PPO (GAE); {type(self).__name__} trains no critic")
        for role, model, section in (("ref", ref_model, c.ref), ("critic", critic_model, c.critic)):
            if model is not None and not is_path(model):
                self._write(
                    inputs / role,
                    lambda m=model, r=role: m.save_pretrained(inputs / r, safe_serialization=True),
                )
                section.model_path = str(inputs / role)
            elif model is not None:
                section.model_path = str(model)

        self.reward_function = None
        funcs = reward_fn if isinstance(reward_fn, (list, tuple)) else [reward_fn]
        trl_style = all(callable(f) for f in funcs) and not (len(funcs) == 1 and is_verl_reward(funcs[0]))
        weights = getattr(args, "reward_weights", None)
        if weights is not None and not trl_style:
            raise UserError("reward_weights weigh a list of TRL-style reward functions (reward_funcs=[...])")
        if trl_style:
            self.reward_function = TRLRewards(
                [keyword_callable(f) for f in funcs], weights, c.data.prompt_key
            )
        elif callable(reward_fn):
            self.reward_function = reward_fn
        elif isinstance(reward_fn, (list, tuple)):
            raise UserError("a list of reward functions takes callables only (TRL's or the positional shape)")
        elif reward_fn is not None and Path(reward_fn).is_dir():  # TRL: a reward model
            c.reward.model_path, c.reward.rule_weight = str(reward_fn), 0.0
        elif reward_fn is not None:
            c.reward.custom_function_path = str(reward_fn)
        for name, dataset, attr in (
            ("train_dataset", train_dataset, "train_files"),
            ("eval_dataset", eval_dataset, "val_files"),
        ):
            if dataset is None:
                continue
            c.data.task = None if attr == "train_files" else c.data.task
            if is_path(dataset) and not trl_style:
                setattr(c.data, attr, [str(dataset)])
                continue
            rows = dataset_rows(dataset, name)
            rows = with_rows_kept(rows) if trl_style else rows
            path = inputs / f"{name.split('_')[0]}.jsonl"
            self._write(path, lambda r=rows, p=path: write_rows(r, p))
            setattr(c.data, attr, [str(path)])
        if trl_style and train_dataset is None:
            raise UserError(
                "a TRL-style reward_fn(prompts, responses, **columns) needs train_dataset (its columns)"
            )

    def _write(self, target: Path, write: Callable[[], None]) -> None:
        self._writes.append((target, write))

    def _write_inputs(self, run_dir: Path) -> None:
        for target, write in self._writes:
            run_manifest.record(run_dir, target)  # before writing: a kill half-way leaves it ours
            write()

    def _trainer(self, max_steps: int | None = None):
        if self._rl is None:
            from hybridflow.controller.trainer import RLTrainer

            config = self.config
            if max_steps is not None:  # the LR schedule spans the first train() call's steps
                config = dataclasses.replace(
                    config, trainer=dataclasses.replace(config.trainer, total_training_steps=max_steps)
                )
            self._rl = RLTrainer(
                config,
                overwrite=self.overwrite,
                reward_function=self.reward_function,
                write_inputs=self._write_inputs,
            )
        return self._rl

    @property
    def run_dir(self) -> Path:
        return Path(self.config.trainer.run_dir)

    @property
    def step(self) -> int:
        return self._rl.step if self._rl is not None else 0

    def train(self, max_steps: int | None = None) -> dict[str, float]:
        """Train to step `max_steps` (default: the config's total); a later call goes on from there.
        The last step's metrics."""
        return self._trainer(max_steps).fit(max_steps, close=False)

    def evaluate(self) -> dict[str, float]:
        """val-core/... metrics of the current policy on eval_dataset (or the config's val files)."""
        return self._trainer().evaluate()

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """The current policy as a transformers directory (config, weights, tokenizer, chat template,
        generation config), reported only after transformers reloads it with the same logits."""
        from hybridflow.models.checkpoint_export import export_checkpoint

        rl = self._trainer()
        latest = rl.last_checkpoint
        if latest is None or latest.name != f"global_step_{rl.step}":
            latest = rl.save()
        print(export_checkpoint(latest, directory, overwrite=overwrite), flush=True)
        return Path(directory)

    def close(self) -> None:
        """Release the workers and reward processes (also on leaving a `with` block)."""
        if self._rl is not None:
            self._rl.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_of(ours: str, value: Any, theirs: str, alias: Any, default: Any = None) -> Any:
    if value is not None and alias is not None:
        raise UserError(f"{ours}= and {theirs}= name the same thing: give one of them")
    return value if value is not None else alias if alias is not None else default


def _apply_peft_config(config: Config, peft_config: Any) -> None:
    """A peft.LoraConfig as our LoRA settings (its rank, alpha and target modules)."""
    rank = getattr(peft_config, "r", None)
    if not rank:
        raise UserError(f"peft_config: expected a peft.LoraConfig, got {type(peft_config).__name__}")
    config.model.lora_rank = int(rank)
    config.model.lora_alpha = float(getattr(peft_config, "lora_alpha", config.model.lora_alpha))
    targets = getattr(peft_config, "target_modules", None)
    if targets == "all-linear" or targets is None:
        return
    config.model.lora_target_modules = sorted(targets)


def _load_tokenizer(tokenizer: Any):
    if is_path(tokenizer):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tokenizer))
    return tokenizer


def _tokenizer_of(model: Any):
    source = getattr(model, "name_or_path", None)
    if source and Path(source).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    raise UserError("actor_model is a live model: pass its tokenizer too (tokenizer=...)")


class GRPOTrainer(Trainer):
    CONFIG = GRPOConfig


class PPOTrainer(Trainer):
    CONFIG = PPOConfig


class DAPOTrainer(Trainer):
    CONFIG = DAPOConfig


class RLOOTrainer(Trainer):
    CONFIG = RLOOConfig


class ReinforcePPTrainer(Trainer):
    CONFIG = ReinforcePPConfig
