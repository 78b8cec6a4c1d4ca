"""The engine's layers on CPU in fp32, with every matmul through oneDNN on weights kept in its
packed layout.

On this project's CPUs (AVX2, 2 cores) oneDNN's matmul on a pre-packed weight runs the engine's
shapes (a few to a few hundred rows against 576-3,072-wide projections and a 49k-152k-wide head)
2-4x faster than the MKL GEMM behind `F.linear` (bench/cpu_rollout.py, docs/benchmarks.md). The
packed copies are made again whenever a source weight changes (an optimizer step in place, a weight
update, a replaced parameter): each is keyed by its sources' addresses and version counters. q/k/v
and gate/up are packed as one matmul each. Norms, RoPE and attention are the trainer's modules, so
the only difference to the trainer's numbers is the matmuls' summation order (fp32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.native.model import NativeCausalLM


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def supports(model: NativeCausalLM, device: torch.device, compute_dtype: torch.dtype) -> bool:
    """fp32 on CPU with plain nn.Linear projections (the engine's merged copy under LoRA is one)."""
    if device.type != "cpu" or compute_dtype != torch.float32 or not onednn_available():
        return False
    if model.config.moe is not None:  # experts are batched per expert by their own block
        return False
    linears = [model.lm_head]
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        linears += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]
    return all(type(x) is nn.Linear and x.weight.dtype == torch.float32 for x in linears)


@dataclass
class PackedLinear:
    """One matmul over the rows of `sources` (one nn.Linear, or several fused), packed for oneDNN."""

    sources: list[nn.Linear]
    key: tuple = ()
    weight: torch.Tensor | None = None  # oneDNN's packed layout, [sum of out, in]
    bias: torch.Tensor | None = None

    def _stamp(self) -> tuple:
        # a parameter replaced (new address) or written in place (its version counter) both change it
        return tuple(
            (p.data_ptr(), p._version) for m in self.sources for p in (m.weight, m.bias) if p is not None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, sum of out]."""
        stamp = self._stamp()
        if stamp != self.key:
            self._pack()
            self.key = stamp
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")

    @torch.no_grad()
    def _pack(self) -> None:
        weights = [m.weight.detach() for m in self.sources]
        whole = weights[0] if len(weights) == 1 else torch.cat(weights)  # [sum of out, in]
        self.weight = torch.ops.mkldnn._reorder_linear_weight(whole, None)
        biases = [m.bias for m in self.sources]
        if all(b is None for b in biases):
            self.bias = None
        else:  # a fused group where some projections have no bias: zeros in their rows
            self.bias = torch.cat(
                [
                    b.detach() if b is not None else whole.new_zeros(m.out_features)
                    for m, b in zip(self.sources, biases)
                ]
            )


class OneDNNLayers:
    """`hidden(ids, pos, cos, sin, attend) -> [N, H]` and `logits(h) -> [N, V]`: the trainer's
    decoder layers with their projections packed (see the module's docstring)."""

    def __init__(self, model: NativeCausalLM) -> None:
        c = model.config
        self.model = model
        self.q_heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.qkv_widths = [self.q_heads * self.head_dim, *[self.kv_heads * self.head_dim] * 2]
        self.mlp_width = c.intermediate_size
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    PackedLinear([a.q_proj, a.k_proj, a.v_proj]),
                    PackedLinear([a.o_proj]),
                    PackedLinear([m.gate_proj, m.up_proj]),
                    PackedLinear([m.down_proj]),
                )
            )
        self.head = PackedLinear([model.lm_head])

    def hidden(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """ids [N]; cos/sin [N, D] -> final hidden states [N, H]; attend(layer, q [N, Hq, D], k, v
        [N, Hkv, D]) -> [N, Hq, D] (it stores k/v in the cache)."""
        backbone = self.model.model
        n, d = ids.shape[0], self.head_dim
        x = backbone.embed_tokens(ids)  # [N, H] residual stream
        for i, (layer, (qkv, o, gate_up, down)) in enumerate(zip(backbone.layers, self.layers)):
            attn = layer.self_attn
            q, k, v = qkv(layer.input_layernorm(x)).split(self.qkv_widths, dim=1)
            q, k, v = attn.position(
                q.view(n, self.q_heads, d), k.view(n, self.kv_heads, d), v.view(n, self.kv_heads, d), cos, sin
            )
            x = x + o(attend(i, q, k, v).flatten(1))
            gate, up = gate_up(layer.post_attention_layernorm(x)).split(self.mlp_width, dim=1)
            x = x + down(F.silu(gate) * up)  # SwiGLU, as the trainer's MLP
        return backbone.norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h.contiguous())
