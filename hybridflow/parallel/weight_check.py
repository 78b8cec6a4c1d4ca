"""After a weight sync, sampled elements of a few tensors on the trainer's side and in every rollout
engine must agree: a sync that copied nothing, the wrong layer or stale LoRA merges would otherwise
train on samples from another policy with no error (a bug others' users lost weeks to).

The trainer's values are cast to the engine's dtype first (the engine keeps matmul weights in the
compute dtype), so agreement is exact. With LoRA only the adapted layers change, so those are the
ones sampled, merged as the sync merges them."""

from __future__ import annotations

import torch

from hybridflow.models.lora import LoRALinear, is_peft, lora_modules, merge

TENSORS_PER_CHECK = 4
ELEMENTS_PER_TENSOR = 4096
MAX_GATHERED_ELEMENTS = 64 * 2**20  # a sharded parameter larger than this is never gathered for it

Plan = list[tuple[str, torch.Tensor]]  # (parameter name, flat element indices [k])


class WeightSyncMismatch(RuntimeError):
    pass


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def trainer_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Name (as the engine names it) -> the trainer's current value, merged where LoRA adapts."""
    adapted = lora_modules(model)
    if adapted:
        return {f"{name}.weight": m for name, m in adapted.items()}  # merged lazily in `sample`
    # PEFT injects its layers into the transformers model's own modules, which the backend runs:
    # the same tensors under the wrapper's prefix
    prefix = "base_model.model." if is_peft(model) else ""
    return {
        name.removeprefix(prefix): p
        for name, p in model.named_parameters()
        if p.numel() <= MAX_GATHERED_ELEMENTS
    }


def make_plan(tensors: dict[str, torch.Tensor], step: int) -> Plan:
    """A few tensors and elements, chosen anew each step (the same on every rank)."""
    names = sorted(tensors)
    gen = torch.Generator().manual_seed(1_000_003 * step + 17)
    chosen = torch.randperm(len(names), generator=gen)[:TENSORS_PER_CHECK].tolist()
    plan = []
    for i in sorted(chosen):
        value = tensors[names[i]]
        numel = value.base.weight.numel() if isinstance(value, LoRALinear) else value.numel()
        plan.append((names[i], torch.randint(numel, (min(ELEMENTS_PER_TENSOR, numel),), generator=gen)))
    return plan


@torch.no_grad()
def sample(tensors: dict, plan: Plan) -> dict[str, torch.Tensor]:
    """The planned elements of each tensor, on the CPU in the tensor's own dtype."""
    out = {}
    for name, idx in plan:
        value = tensors[name]
        if isinstance(value, LoRALinear):  # gathered whole where sharded, then merged as the sync merges
            parts = (value.base.weight, value.lora_A, value.lora_B)
            value = merge(*(_full(t) for t in parts), value.scale)
        else:
            value = _full(value)
        flat = value.detach().reshape(-1)
        out[name] = flat[idx.to(flat.device)].cpu()
    return out


def compare(
    trainer: dict[str, torch.Tensor], engine: dict[str, torch.Tensor], *, step: int, where: str
) -> None:
    for name, want in trainer.items():
        if name not in engine:
            raise WeightSyncMismatch(f"step {step}: {where} has no tensor {name!r} after the weight sync")
        got = engine[name]
        want = want.to(got.dtype)
        if not torch.equal(want, got):
            differ = (want != got).sum().item()
            raise WeightSyncMismatch(
                f"step {step}: after the weight sync {where}'s {name} differs from the trainer's in {differ} of "
                f"{got.numel()} sampled elements (max |diff| {(want.double() - got.double()).abs().max().item():.3g}): "
                "the engine is generating with other weights than the ones being trained. Turn the check off "
                "with trainer.guards.weight_sync_check=false"
            )
