"""TRL's offline trainers' calling convention for ours: `SFTTrainer(model=..., train_dataset=...,
args=SFTConfig(...), processing_class=...)`, `DPOTrainer(...)`, `KTOTrainer(...)`, then
`trainer.train()` and `trainer.save_model(dir)`. The config classes take TRL's names with TRL's
defaults (trl 1.16) and say at start where hybridflow keeps its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hybridflow.api.configs import _NamesChecked, _nest
from hybridflow.api.inputs import INPUTS, dataset_rows, is_path, write_model
from hybridflow.api.trl_config import SCHEDULERS
from hybridflow.config import Config, load_config
from hybridflow.errors import UserError


@dataclass
class _OfflineConfig(metaclass=_NamesChecked):
    """TRL's TrainingArguments fields the offline trainers read; None: TRL's default."""

    output_dir: str | None = None
    learning_rate: float | None = None
    num_train_epochs: float = 3.0
    max_steps: int = -1
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    max_length: int | None = 1024
    seed: int = 42
    lr_scheduler_type: str = "linear"
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    save_steps: int | None = None
    logging_steps: float | None = None
    bf16: bool | None = None
    gradient_checkpointing: bool | None = None
    report_to: str | list[str] | None = None

    SECTION: ClassVar[str] = "sft"
    LEARNING_RATE: ClassVar[float] = 1e-6
    DIFFERENCES: ClassVar[str] = ""

    def _settings(self) -> dict[str, Any]:
        batch = self.per_device_train_batch_size * self.gradient_accumulation_steps
        if float(self.num_train_epochs) != int(self.num_train_epochs):
            raise UserError(f"num_train_epochs={self.num_train_epochs}: give a whole number of passes")
        if self.lr_scheduler_type not in SCHEDULERS:
            raise UserError(
                f"lr_scheduler_type={self.lr_scheduler_type!r}: supported are {', '.join(SCHEDULERS)}"
            )
        flat = {
            "trainer.run_dir": self.output_dir or "trainer_output",  # TRL's default output_dir
            "actor.optim.lr": self.learning_rate if self.learning_rate is not None else self.LEARNING_RATE,
            "trainer.total_epochs": int(self.num_train_epochs),
            "trainer.total_training_steps": self.max_steps if self.max_steps > 0 else None,
            f"{self.SECTION}.batch_size": batch,
            f"{self.SECTION}.max_tokens": self.max_length or 1 << 30,
            "trainer.seed": self.seed,
            "actor.optim.lr_scheduler": SCHEDULERS[self.lr_scheduler_type],
            "actor.optim.warmup_ratio": self.warmup_ratio,
            "actor.optim.weight_decay": self.weight_decay,
            "actor.optim.grad_clip": self.max_grad_norm,
            "trainer.save_freq": self.save_steps,
            "model.enable_gradient_checkpointing": self.gradient_checkpointing,
        }
        if self.bf16:
            flat["actor.compute_dtype"] = "bfloat16"
        if self.report_to is not None:
            names = [self.report_to] if isinstance(self.report_to, str) else list(self.report_to)
            names = ["tensorboard", "wandb"] if names == ["all"] else [n for n in names if n != "none"]
            flat["trainer.logger"] = ["console", *names]
        return {k: v for k, v in flat.items() if v is not None}

    def to_config(self) -> Config:
        tree: dict[str, Any] = {}
        for key, value in self._settings().items():
            _merge_into(tree, _nest(key, value))
        return load_config(None, settings=tree)

    def notes(self) -> list[str]:
        return [f"{type(self).__name__} starts from TRL's defaults, except {self.DIFFERENCES}"]


@dataclass
class SFTConfig(_OfflineConfig):
    """TRL's SFTConfig names and defaults (learning rate 2e-5, 3 epochs, 8 examples a step, 1,024
    tokens)."""

    assistant_only_loss: bool = False
    completion_only_loss: bool | None = None
    packing: bool = False
    dataset_text_field: str = "text"

    LEARNING_RATE: ClassVar[float] = 2e-5
    DIFFERENCES: ClassVar[str] = (
        "a conversation's loss is on its assistant turns only (TRL's assistant_only_loss=True; its default "
        "also trains on the user's and system's tokens); examples are always packed into micro-batches "
        "without attention across them (packing changes memory, not results); longer examples are dropped "
        "and counted, not truncated"
    )

    def _settings(self) -> dict[str, Any]:
        if self.completion_only_loss is False:
            raise UserError("completion_only_loss=False is not supported: the loss is on the completion")
        out = super()._settings()
        if self.dataset_text_field != "text":
            raise UserError(
                f"dataset_text_field={self.dataset_text_field!r}: rows are read as TRL's formats by their "
                "columns (text, messages, prompt + completion); rename the column to text"
            )
        return out


@dataclass
class DPOConfig(_OfflineConfig):
    """TRL's DPOConfig names and defaults (beta 0.1, sigmoid loss, learning rate 1e-6)."""

    beta: float = 0.1
    loss_type: str | list[str] = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None
    precompute_ref_log_probs: bool = False

    SECTION: ClassVar[str] = "preference"
    DIFFERENCES: ClassVar[str] = (
        "the reference's log-probs are computed once before training unless precompute_ref_log_probs is "
        "set false (the same numbers, fewer forwards); longer pairs are dropped and counted, not truncated"
    )

    def _settings(self) -> dict[str, Any]:
        out = super()._settings()
        loss = self.loss_type if isinstance(self.loss_type, str) else list(self.loss_type)
        if isinstance(loss, list):
            if len(loss) != 1:
                raise UserError(f"loss_type={loss}: one loss type at a time here")
            loss = loss[0]
        out |= {"preference.beta": self.beta, "preference.loss_type": loss,
                "preference.label_smoothing": self.label_smoothing,
                "preference.rpo_alpha": self.rpo_alpha or 0.0}  # fmt: skip
        return out


@dataclass
class KTOConfig(_OfflineConfig):
    """TRL's KTOConfig names and defaults (beta 0.1, equal weights, learning rate 1e-6)."""

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    SECTION: ClassVar[str] = "preference"
    DIFFERENCES: ClassVar[str] = "longer examples are dropped and counted, not truncated"

    def _settings(self) -> dict[str, Any]:
        return super()._settings() | {
            "preference.beta": self.beta,
            "preference.desirable_weight": self.desirable_weight,
            "preference.undesirable_weight": self.undesirable_weight,
        }


def _merge_into(into: dict, tree: dict) -> None:
    for k, v in tree.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge_into(into[k], v)
        else:
            into[k] = v


def trl_offline_config(
    kind: type[_OfflineConfig],
    *,
    model: Any,
    args: _OfflineConfig | Config | None,
    train_dataset: Any,
    eval_dataset: Any,
    processing_class: Any,
    peft_config: Any,
) -> tuple[Config, list, list[str]]:
    """(config, the inputs to write under run_dir/inputs once the run directory is ours, notes) for
    a trainer called TRL's way."""
    from hybridflow.api.trainers import _apply_peft_config, _load_tokenizer, _tokenizer_of
    from hybridflow.data.files import write_rows

    if args is not None and not isinstance(args, (kind, Config)):
        raise UserError(
            f"args: expected a {kind.__name__} (hybridflow's, with TRL's names), got {type(args).__name__}"
        )
    if isinstance(args, Config):
        config, notes = dataclasses.replace(args), []
    else:
        args = args if args is not None else kind()
        config, notes = args.to_config(), args.notes()
    if model is None:
        raise UserError("model: give a model (a transformers model, an HF directory, a .gguf or 'default')")
    if peft_config is not None:
        _apply_peft_config(config, peft_config)
    inputs = Path(config.trainer.run_dir) / INPUTS
    writes: list = []
    if not is_path(model) or processing_class is not None:
        tokenizer = _tokenizer_of(model) if processing_class is None else _load_tokenizer(processing_class)
        writes.append((inputs / "actor", lambda: write_model(model, tokenizer, inputs / "actor")))
        config.model.path = str(inputs / "actor")
    else:
        config.model.path = str(model)
    if train_dataset is None:
        raise UserError(
            "train_dataset: give the training rows (a datasets.Dataset, a list of dicts or files)"
        )
    for name, dataset, attr in (
        ("train_dataset", train_dataset, "train_files"),
        ("eval_dataset", eval_dataset, "val_files"),
    ):
        if dataset is None:
            continue
        rows = dataset_rows(dataset, name)
        path = inputs / f"{name.split('_')[0]}.jsonl"
        writes.append((path, lambda r=rows, p=path: write_rows(r, p)))
        setattr(config.data, attr, [str(path)])
    config.data.task = None
    return config, writes, notes
