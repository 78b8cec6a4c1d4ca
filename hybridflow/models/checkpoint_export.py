"""`hybridflow export CHECKPOINT --out DIR`: a checkpoint's trained policy as a transformers
directory (config, safetensors, tokenizer with its chat template, generation config). The weights
come from the sharded actor state, whatever number of ranks wrote it; success is reported only
after transformers has loaded the written directory and its logits equal the checkpoint's."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridflow.checkpoint import latest_checkpoint
from hybridflow.devices import DTYPES
from hybridflow.errors import UserError
from hybridflow.models import native
from hybridflow.models.export import save_hf
from hybridflow.models.loading import load_causal_lm
from hybridflow.models.lora import (
    apply_lora,
    is_peft,
    load_adapter,
    merged_state_dict,
    peft_lora_config,
    read_adapter_config,
    save_adapter,
    sequence_logits,
)
from hybridflow.parallel.checkpoint import load_model_weights, saved_weight_names
from hybridflow.permissions import as_user_files

ADAPTER = "policy_adapter"  # a LoRA run's adapters in PEFT's format, beside the merged policy/
PROBE = [{"role": "user", "content": "What is 17 + 25? Answer with a number."}]


@dataclass
class ExportReport:
    checkpoint: Path
    out: Path
    parameters: int
    max_logit_diff: float
    probe_tokens: int

    def __str__(self) -> str:
        return (
            f"exported {self.checkpoint} -> {self.out} ({self.parameters / 1e6:.1f}M parameters); "
            f"transformers reloads it with the same logits (max |diff| {self.max_logit_diff:.1e} over "
            f"{self.probe_tokens} tokens)"
        )


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory (global_step_N), or a run directory (its latest complete checkpoint)."""
    p = Path(path).expanduser()
    if (p / "trainer_state.json").is_file():
        return p
    if p.is_dir() and (latest := latest_checkpoint(p)) is not None:
        return latest
    raise UserError(
        f"{p} is neither a checkpoint (global_step_N with trainer_state.json) nor a run directory holding one"
    )


def load_trained_policy(checkpoint: Path):
    """(transformers model, tokenizer): the structure and tokenizer of the checkpoint's policy
    export, the weights read from its sharded actor state."""
    policy, state_dir = checkpoint / "policy", checkpoint / "actor_state"
    if not (policy / "config.json").is_file() or not (state_dir / ".metadata").is_file():
        raise UserError(
            f"checkpoint {checkpoint} lacks policy/config.json or actor_state/: not written by hybridflow?"
        )
    model, tokenizer = load_causal_lm(str(policy), dtype=_saved_dtype(policy))
    if (checkpoint / ADAPTER / "adapter_config.json").is_file():
        lora = _trained_lora(model, checkpoint)
        if is_peft(lora):
            return copy.deepcopy(lora).merge_and_unload().eval(), tokenizer
        return native.to_hf_model(merged_state_dict(lora), model.config).eval(), tokenizer
    return _load_actor_state(model, checkpoint), tokenizer


def _load_actor_state(model, checkpoint: Path):
    """`model` with every weight read from the checkpoint's sharded actor state."""
    own = model.state_dict()
    weights = load_model_weights(checkpoint / "actor_state", own)
    missing = [n for n in own if n not in weights and not _tied(model, n)]
    if missing:
        raise UserError(f"checkpoint {checkpoint}: actor_state has no weights for {', '.join(missing[:3])}")
    model.load_state_dict(weights, strict=False)  # a tied head is the embedding's tensor
    return model.eval()


def _trained_lora(hf_model, checkpoint: Path):
    """The trained model of a LoRA run, base and adapters from actor_state: ours, or PEFT's for a
    family without our native code."""
    adapter = read_adapter_config(checkpoint / ADAPTER)
    trained_by_peft = any(
        n.startswith("base_model.model.") for n in saved_weight_names(checkpoint / "actor_state")
    )
    if not trained_by_peft:
        model = native.from_hf_model(hf_model)
        apply_lora(model, adapter["r"], adapter["lora_alpha"], adapter["target_modules"])
    else:
        from peft import get_peft_model

        model = get_peft_model(
            hf_model, peft_lora_config(adapter["r"], adapter["lora_alpha"], adapter["target_modules"])
        )
    return _load_actor_state(model, checkpoint)


def _saved_dtype(policy: Path) -> str:
    """The dtype the policy export was written in (its config's), so the weights load unconverted."""
    config = json.loads((policy / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype")
    return name if name in DTYPES else "float32"


def _tied(model, name: str) -> bool:
    return name.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))


def export_adapter(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> ExportReport:
    """A LoRA run's adapters alone, in PEFT's format; checked by applying them to the base model
    anew and comparing logits with the merged policy's."""
    source = resolve_checkpoint(checkpoint)
    if not (source / ADAPTER / "adapter_config.json").is_file():
        raise UserError(
            f"{source} holds no LoRA adapters (the run had model.lora_rank = 0): export without --adapter-only"
        )
    hf_model, tokenizer = load_causal_lm(str(source / "policy"), dtype=_saved_dtype(source / "policy"))
    trained = _trained_lora(hf_model, source)
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} is not empty; pass --overwrite to replace its files")
    config = read_adapter_config(source / ADAPTER)
    probe = _probe(tokenizer)
    if is_peft(trained):
        from peft import PeftModel

        trained.save_pretrained(out)
        fresh = PeftModel.from_pretrained(copy.deepcopy(trained).unload(), out).eval()  # the base + the files
        with torch.no_grad():
            diff = (fresh(probe).logits - trained(probe).logits).abs().max().item()
    else:
        save_adapter(trained, out, base_model=config.get("base_model_name_or_path"))
        fresh = native.from_hf_model(hf_model)  # base weights come from actor_state: adapters off = base
        apply_lora(fresh, config["r"], config["lora_alpha"], config["target_modules"])
        fresh.load_state_dict(
            {k: v for k, v in trained.state_dict().items() if ".lora_" not in k}, strict=False
        )
        load_adapter(fresh, out)
        with torch.no_grad():
            diff = (sequence_logits(fresh, probe[0]) - sequence_logits(trained, probe[0])).abs().max().item()
    tokenizer.save_pretrained(out)
    as_user_files(out)
    if diff > 1e-5:
        raise UserError(f"adapter check failed: {out} applied to the base gives logits {diff:.2e} away")
    count = sum(p.numel() for n, p in trained.named_parameters() if ".lora_" in n)
    return ExportReport(source, out, count, diff, probe.shape[1])


def _probe(tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, return_dict=False) if tokenizer.chat_template else tokenizer("17 + 25 =")["input_ids"]  # fmt: skip
    return torch.tensor([list(ids)])  # [1, T]


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> ExportReport:
    """The trained policy as a transformers directory (a LoRA run's adapters merged into it)."""
    from transformers import AutoModelForCausalLM

    source = resolve_checkpoint(checkpoint)
    model, tokenizer = load_trained_policy(source)
    out = save_hf(model, tokenizer, out, overwrite=overwrite)
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=next(model.parameters()).dtype).eval()
    probe = _probe(tokenizer)
    with torch.no_grad():
        diff = (reloaded(probe).logits - model(probe).logits).abs().max().item()
    if diff > 1e-5:
        raise UserError(f"export check failed: {out} reloads with logits {diff:.2e} away from {source}'s")
    return ExportReport(source, Path(out), sum(p.numel() for p in model.parameters()), diff, probe.shape[1])
