"""LoRA (Hu et al. 2021) on our native model: chosen linear layers of the decoder blocks get trainable
low-rank adapters, y = W x + (alpha / r) B A x, with W frozen. The reference policy is the same model
with its adapters switched off; the rollout engine holds plain merged weights, W + (alpha / r) B A,
which each sync recomputes for the adapted layers only. Adapters are read and written in PEFT's
format (adapter_config.json + adapter_model.safetensors), so PEFT and transformers load them.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hybridflow.errors import UserError

PEFT_PREFIX = "base_model.model."


class LoRALinear(nn.Module):
    """A frozen nn.Linear plus a trainable rank-r update (PEFT's init: A Kaiming-uniform, B zero, so
    the wrapped layer starts equal to the base)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        w = base.weight
        self.lora_A = nn.Parameter(
            torch.empty(rank, base.in_features, dtype=w.dtype, device=w.device)
        )  # [r, in]
        self.lora_B = nn.Parameter(
            torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device)
        )  # [out, r]
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.enabled = True
        self.merged_forward = False
        """Compute with the merged weight (the engine's, rounded alike) instead of W x + s B (A x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if not self.enabled:
            return self.base(x)
        if self.merged_forward:  # autocast rounds the merged weight as the engine's copy is rounded
            with torch.autocast(x.device.type, enabled=False):  # B A in fp32, as merged_weight's
                weight = self._merge()
            return nn.functional.linear(x, weight, self.base.bias)
        out = self.base(x)
        return out + nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B) * self.scale

    def _merge(self) -> torch.Tensor:
        """W + scale * B A [out, in] in the base weight's dtype (differentiable in A and B)."""
        return merge(self.base.weight, self.lora_A, self.lora_B, self.scale)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + scale * B A [out, in], in the base weight's dtype: what the engine runs."""
        return self._merge()


def merge(weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scale: float) -> torch.Tensor:
    """W [out, in] + scale * B [out, r] A [r, in], B A in fp32, in W's dtype. The sync, its check and
    the export all merge here, from whole (unsharded) tensors, so the three agree to the bit."""
    update = (lora_B.float() @ lora_A.float()) * scale
    return (weight.float() + update).to(weight.dtype)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def has_adapters(model: nn.Module) -> bool:
    return is_peft(model) or bool(lora_modules(model))


def apply_lora(
    model: nn.Module,
    rank: int,
    alpha: float,
    targets: list[str] | tuple[str, ...],
    merged_forward: bool = False,
) -> int:
    """Freeze `model` and wrap the decoder blocks' linear layers named in `targets` (in place);
    returns how many were wrapped. `merged_forward`: see LoRALinear.merged_forward."""
    model.requires_grad_(False)
    wrapped = 0
    for name, module in list(model.named_modules()):
        if not name.startswith("model.layers."):
            continue
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name in targets:
                adapted = LoRALinear(child, rank, alpha)
                adapted.merged_forward = merged_forward
                setattr(module, child_name, adapted)
                wrapped += 1
    if not wrapped:
        raise UserError(
            f"model.lora_target_modules={list(targets)} names no linear layer of the decoder blocks"
        )
    return wrapped


@contextmanager
def adapters_disabled(model: nn.Module):
    """The base model: every adapter off inside the block (the reference policy); ours or PEFT's."""
    if is_peft(model):
        with model.disable_adapter():
            yield model
        return
    modules = list(lora_modules(model).values())
    for m in modules:
        m.enabled = False
    try:
        yield model
    finally:
        for m in modules:
            m.enabled = True


def merged_updates(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(plain parameter name, merged weight) of every adapted layer: all a sync has to send, since
    nothing else trains."""
    for name, m in lora_modules(model).items():
        yield f"{name}.weight", m.merged_weight()


def merged_state_dict(
    model: nn.Module, state: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The whole model's weights under plain names (as without LoRA), adapters merged; from `state`
    (the model's full state dict, gathered from FSDP shards) where given, else the model's own."""
    state = model.state_dict(keep_vars=False) if state is None else state
    adapted = lora_modules(model)
    out = {}
    for name, p in state.items():
        owner = next((m for m in adapted if name.startswith(f"{m}.")), None)
        if owner is None:
            out[name] = p
        elif name == f"{owner}.base.bias":
            out[f"{owner}.bias"] = p
    for name, m in adapted.items():
        parts = (state[f"{name}.base.weight"], state[f"{name}.lora_A"], state[f"{name}.lora_B"])
        out[f"{name}.weight"] = merge(*(t.detach() for t in parts), m.scale)
    return out


def merged_model(model: nn.Module) -> nn.Module:
    """A copy of `model` whose adapted layers are plain nn.Linear with merged weights."""
    out = copy.deepcopy(model)
    for name, m in lora_modules(out).items():
        parent_name, _, child = name.rpartition(".")
        linear = m.base
        linear.weight.data = m.merged_weight()
        setattr(out.get_submodule(parent_name), child, linear)
    return out


def sequence_logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of one sequence ids [T] through our packed model (probes and checks)."""
    positions = torch.arange(ids.shape[0], device=ids.device)
    return model(ids, positions, torch.tensor([0, ids.shape[0]], dtype=torch.int32, device=ids.device))


def peft_lora_config(rank: int, alpha: float, targets):
    """PEFT's LoraConfig for the same adapters as ours: no dropout, no bias, a causal LM."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM")  # fmt: skip


# ---- PEFT's adapter format -------------------------------------------------------------------------
def save_adapter(model: nn.Module, directory: Path, *, base_model: str | None = None,
                 state: dict[str, torch.Tensor] | None = None) -> None:  # fmt: skip
    """adapter_model.safetensors (PEFT's key names) and adapter_config.json; the tensors from `state`
    (the model's full state dict, gathered from FSDP shards) where given, else the model's own."""
    state = model.state_dict(keep_vars=False) if state is None else state
    adapted = lora_modules(model)
    if not adapted:
        raise UserError("the model has no LoRA adapters to save")
    first = next(iter(adapted.values()))
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name in adapted:
        for part in ("lora_A", "lora_B"):
            tensors[f"{PEFT_PREFIX}{name}.{part}.weight"] = (
                state[f"{name}.{part}"].detach().cpu().contiguous()
            )
    save_file(tensors, directory / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": first.rank,
        "lora_alpha": first.alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": sorted({name.rsplit(".", 1)[1] for name in adapted}),
        "base_model_name_or_path": base_model,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def read_adapter_config(directory: str | Path) -> dict:
    path = Path(directory) / "adapter_config.json"
    if not path.is_file():
        raise UserError(f"model.lora_adapter_path: {path} not found (a PEFT adapter directory holds it)")
    config = json.loads(path.read_text(encoding="utf-8"))
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    return config


def load_adapter(model: nn.Module, directory: str | Path) -> None:
    """Copy a PEFT LoRA adapter's A and B into the model's adapters (same rank, same layers)."""
    directory = Path(directory)
    read_adapter_config(directory)
    file = directory / "adapter_model.safetensors"
    if not file.is_file():
        raise UserError(f"model.lora_adapter_path: {file} not found")
    tensors = load_file(file)
    adapted = lora_modules(model)
    for name, m in adapted.items():
        for part, param in (("lora_A", m.lora_A), ("lora_B", m.lora_B)):
            key = next(
                (
                    k
                    for k in (
                        f"{PEFT_PREFIX}{name}.{part}.weight",
                        f"{PEFT_PREFIX}{name}.{part}.default.weight",
                    )
                    if k in tensors
                ),
                None,
            )
            if key is None:
                raise UserError(f"{file} has no {part} for {name} (adapted here: model.lora_target_modules)")
            if tensors[key].shape != param.shape:
                raise UserError(
                    f"{file}: {key} has shape {tuple(tensors[key].shape)}, the model's adapter {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensors[key])
    extra = {k for k in tensors if not any(k.startswith(f"{PEFT_PREFIX}{name}.") for name in adapted)}
    if extra:
        raise UserError(
            f"{file} adapts layers this model does not ({sorted(extra)[0]}, ...): check model.lora_target_modules"
        )


def lora_reference(config) -> bool:
    """The run's reference is the policy's base with its LoRA adapters off (no model of its own)."""
    return bool(config.model.lora_rank or config.model.lora_adapter_path) and not config.ref.model_path
