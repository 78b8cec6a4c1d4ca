"""The engine's copy of the policy, and in-place weight updates from the trainer.

Matmul weights are kept in the compute dtype (bf16 on GPU) so decode reads half the bytes; the
embedding and norm weights stay in the trainer's master dtype, and the forward runs under the same
autocast as the trainer, so both compute the same numbers (autocast rounds the trainer's fp32 matmul
weights to bf16 exactly as this copy is rounded). A tied LM head gets its own copy in compute dtype."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hybridflow.models.native.model import NativeCausalLM
from hybridflow.models.native.moe import Experts, Router
from hybridflow.parallel.tensor import local_part

if TYPE_CHECKING:
    from hybridflow.engine.triton_copy import CastCopyPlan


def engine_model(model: NativeCausalLM, device: torch.device, compute_dtype: torch.dtype) -> NativeCausalLM:
    """A copy of `model` on `device` with matmul weights in `compute_dtype` (built afresh, so the
    trainer's compiled layers are not carried over); of a meta model, zeros to be updated."""
    master = next(model.parameters()).dtype
    with torch.device("meta"):
        out = NativeCausalLM(model.config)
    out = out.to_empty(device=device).to(master)
    if model.config.tie_word_embeddings:
        out.lm_head.weight = out.model.embed_tokens.weight
    if next(model.parameters()).is_meta:  # the shape alone: the weights come with the first update
        for p in out.parameters():
            p.detach().zero_()
    else:
        out.load_state_dict(model.state_dict())
    out.eval().requires_grad_(False)
    if compute_dtype == master:
        return out
    for module in out.modules():
        if isinstance(module, (nn.Linear, Experts, Router)) and module is not out.lm_head:
            module.to(compute_dtype)
    out.lm_head.weight = nn.Parameter(
        out.lm_head.weight.detach().to(compute_dtype).clone(), requires_grad=False
    )
    return out


def weight_targets(model: NativeCausalLM) -> dict[str, list[torch.Tensor]]:
    """Trainer parameter name -> the engine tensors it fills (two for a tied embedding)."""
    targets = {name: [p] for name, p in model.named_parameters(remove_duplicate=False)}
    if model.config.tie_word_embeddings:
        targets["model.embed_tokens.weight"] = [
            model.model.embed_tokens.weight,
            *([model.lm_head.weight] if model.lm_head.weight is not model.model.embed_tokens.weight else []),
        ]
        targets.pop("lm_head.weight", None)
    return targets


def _local(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tensors a copy writes and reads: for a tensor-parallel copy's parameter, this rank's part."""
    if isinstance(dst, DTensor):
        return dst.to_local(), local_part(src, dst)
    return dst, src


class WeightUpdater:
    """Copies (and casts) trainer tensors into the engine's tensors in place, so captured decode
    graphs stay valid. On CUDA the copies run as one Triton launch per dtype pair, from a plan that
    is kept while the same tensors come back at the same addresses (a trainer's parameters) and
    made again otherwise (layers gathered from FSDP shards). The first update plans too, so the
    kernel compiles then (the first step) and not in the middle of a later step. A tensor-parallel
    copy takes whole tensors, or the trainer's DTensors, and writes its own part of each."""

    def __init__(self, targets: dict[str, list[torch.Tensor]]) -> None:
        self.targets = targets
        self._plan: CastCopyPlan | None = None
        self._key: tuple | None = None
        self._sources: list[torch.Tensor] = []  # kept alive: the plan holds their addresses
        self._written = 0

    @torch.no_grad()
    def __call__(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Returns the bytes written (0 where a source is the engine's own tensor)."""
        pairs = list(named_tensors)
        # the hot path (a trainer's parameters again): one look at each address, then one launch
        key = (tuple([n for n, _ in pairs]), tuple([t.data_ptr() for _, t in pairs]))
        if self._plan is not None and key == self._key:
            self._plan()
            return self._written
        for name, _ in pairs:
            if name not in self.targets:
                raise KeyError(f"update_weights: the engine's model has no parameter {name!r}")
        copies = []
        for name, whole in pairs:
            for target in self.targets[name]:
                dst, src = _local(target, whole)
                if dst.data_ptr() != src.data_ptr():
                    copies.append((dst, src))
        written = sum(dst.numel() * dst.element_size() for dst, _ in copies)
        self._plan, self._key, self._sources = None, None, []
        if copies and all(
            d.is_cuda and s.is_cuda and d.is_contiguous() and s.is_contiguous() for d, s in copies
        ):
            from hybridflow.engine.triton_copy import CastCopyPlan

            dsts, srcs = zip(*copies, strict=True)
            self._plan = CastCopyPlan(list(dsts), list(srcs))
            self._key, self._sources, self._written = key, [t for _, t in pairs], written
            self._plan()
            return written
        for dst, src in copies:
            dst.copy_(src)
        return written
