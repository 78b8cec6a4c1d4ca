"""The engine's decode step in few kernels (Triton, on CUDA; prefill runs the same layers). Per layer: a norm, the QKV matmul,
rotary + K/V store, paged attention, the output matmul, residual add + norm, the gate/up matmul,
SwiGLU, the down matmul (nine launches, where the trainer's modules take ~45); then the LM head and,
for the whole-step form, a sampler that records its draw and feeds the next step on the device, so
a run of steps is graph replays with no host work between them.

The numbers are the trainer's: each kernel rounds where the trainer's layer rounds (the residual
stream in the master dtype, matmul inputs in the compute dtype). The engine's own copy of the
weights holds each layer's q/k/v and gate/up projections as views of one tensor (`fuse_projections`),
so one matmul computes them and in-place weight updates still land; a module shared with the
trainer keeps separate projections, one matmul each."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.native.model import NativeCausalLM, stacked


def _fuse(linears: list[nn.Linear]) -> None:
    """Move the weights (and biases) of `linears` into one tensor each, rows stacked, and make each
    module's parameter a view of its rows."""
    for name in ("weight", "bias"):
        parts = [getattr(m, name) for m in linears]
        if any(p is None for p in parts):  # (biases on some only: they stay apart, as the weights' matmul)
            continue
        whole = torch.cat([p.detach() for p in parts])
        start = 0
        for m, p in zip(linears, parts):
            rows = p.shape[0]
            setattr(m, name, nn.Parameter(whole[start : start + rows], requires_grad=False))
            start += rows


def fuse_projections(model: NativeCausalLM) -> None:
    """In the engine's own copy: each layer's q/k/v projections, and gate/up, as row views of one
    weight tensor (and one bias), so the decode step runs one matmul for each group."""
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        _fuse([a.q_proj, a.k_proj, a.v_proj])
        if hasattr(m, "gate_proj"):  # a dense MLP (an expert block keeps gate and up fused already)
            _fuse([m.gate_proj, m.up_proj])


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: list[tuple[torch.Tensor, torch.Tensor | None]]  # one fused (weight, bias) or q, k, v
    o: tuple[torch.Tensor, torch.Tensor | None]
    gate_up: list[tuple[torch.Tensor, torch.Tensor | None]]  # one fused, or gate and up
    down: tuple[torch.Tensor, torch.Tensor | None]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


def _group(linears: list[nn.Linear]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """One (weight, bias) over `linears` where they are `stacked` (fuse_projections made them so);
    else one pair per module."""
    pair = stacked(linears)
    return [pair] if pair is not None else [(m.weight, m.bias) for m in linears]


def layer_weights(model: NativeCausalLM) -> list[LayerWeights]:
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out.append(
            LayerWeights(
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                qkv=_group([a.q_proj, a.k_proj, a.v_proj]),
                o=(a.o_proj.weight, a.o_proj.bias),
                gate_up=_group([m.gate_proj, m.up_proj]),
                down=(m.down_proj.weight, m.down_proj.bias),
                q_norm=a.q_norm.weight if a.q_norm is not None else None,
                k_norm=a.k_norm.weight if a.k_norm is not None else None,
            )
        )
    return out


def _project(x: torch.Tensor, group, widths: list[int]) -> list[torch.Tensor]:
    """x [B, H] -> one [B, w] output per width (column views of one matmul when fused)."""
    if len(group) == 1:
        weight, bias = group[0]
        return list(F.linear(x, weight, bias).split(widths, dim=1))
    return [F.linear(x, weight, bias) for weight, bias in group]


class FusedDecode:
    """`forward(ids, pos, slots, ctx, table) -> logits` over the engine's model and KV cache (the
    runner's whole step wraps it: prepare, forward, draw, record); every launch is capturable in a
    CUDA graph."""

    def __init__(self, model: NativeCausalLM, cache, cos: torch.Tensor, sin: torch.Tensor, compute_dtype):
        c = model.config
        self.model, self.cache, self.cos, self.sin = model, cache, cos, sin
        self.compute_dtype = compute_dtype
        self.eps = c.rms_norm_eps
        self.q_heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.qkv_widths = [self.q_heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2]
        self.mlp_widths = [c.intermediate_size] * 2
        self.layers: list[LayerWeights] | None = None  # looked up at the next forward

    def forget_weights(self) -> None:
        """Look the weights up again at the next forward (the runner calls this at every sleep and
        before every graph capture, so a module whose parameters were replaced is not run with the
        old ones; between those, a forward reuses the lookup: ~1 ms of Python for 28 layers)."""
        self.layers = None

    def _look_up_weights(self) -> None:
        if self.layers is not None:
            return
        self.layers = layer_weights(self.model)
        self.embed = self.model.model.embed_tokens.weight
        self.final_norm = self.model.model.norm.weight
        self.lm_head = self.model.lm_head.weight

    def hidden(self, ids, pos, slots, attend, *, rotated_k: bool = False) -> torch.Tensor:
        """ids, pos, slots [N] int64 -> the final norm's output [N, H] in the compute dtype (what the
        LM head multiplies). Each layer stores its tokens' K/V at `slots`, then calls
        attend(layer, q [N, Hq, D], k, v) -> [N, Hq, D]; k is the rotated k [N, Hkv, D] with
        `rotated_k` (else None), v the projection's [N, Hkv * D] (a view)."""
        from hybridflow.engine.triton_layer import rms_norm, rope_store, silu_mul

        self._look_up_weights()
        rows, cdt, cache, dev = ids.shape[0], self.compute_dtype, self.cache, ids.device
        hidden = self.embed.shape[1]
        x = torch.empty(rows, hidden, dtype=self.embed.dtype, device=dev)  # residual stream
        h = torch.empty(rows, hidden, dtype=cdt, device=dev)  # normed, for the next matmul
        rms_norm(x, self.layers[0].input_norm, self.eps, h, ids=ids, embed=self.embed)
        for i, layer in enumerate(self.layers):
            q, k, v = _project(h, layer.qkv, self.qkv_widths)
            q_rot = torch.empty(rows, self.q_heads, self.head_dim, dtype=cdt, device=dev)
            k_rot = (
                torch.empty(rows, self.kv_heads, self.head_dim, dtype=cdt, device=dev) if rotated_k else None
            )
            rope_store(
                q, k, v, self.cos, self.sin, pos, slots, q_rot, cache.k[i], cache.v[i],
                q_norm=layer.q_norm, k_norm=layer.k_norm, eps=self.eps, k_out=k_rot,
            )  # fmt: skip
            o = F.linear(attend(i, q_rot, k_rot, v).flatten(1), *layer.o)
            rms_norm(x, layer.post_norm, self.eps, h, residual=o)
            gate, up = _project(h, layer.gate_up, self.mlp_widths)
            act = torch.empty(rows, self.mlp_widths[0], dtype=cdt, device=dev)
            silu_mul(gate, up, act)
            down = F.linear(act, *layer.down)
            following = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.final_norm
            rms_norm(x, following, self.eps, h, residual=down)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head)

    def forward(self, ids, pos, slots, ctx, table) -> torch.Tensor:
        """A decode step: ids, pos, slots [R] int64, ctx [R] int32, table [R, P] int32 -> logits [R, V]."""
        from hybridflow.engine.triton_decode import paged_decode_attention_triton

        cache = self.cache

        def attend(i, q, k, v):
            return paged_decode_attention_triton(q, cache.k[i], cache.v[i], table, ctx, cache.page_size)

        return self.logits(self.hidden(ids, pos, slots, attend))
