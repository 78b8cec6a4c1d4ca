"""Our decoder for the Llama / Mistral / Qwen2 / Qwen3 family: single-device, padding-free.

The input is a packed token stream: input_ids [N] with position_ids [N] restarting at 0 for every
sequence, and cu_seqlens [B + 1] marking sequence boundaries. Attention runs per sequence only.
Parameter names equal transformers' (model.layers.N.self_attn.q_proj.weight, ...), so HF
checkpoints load and save without renaming.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.models.native.config import NativeConfig
from hybridflow.models.native.moe import SparseMoE
from hybridflow.models.native.rope import rope_cos_sin


class RMSNorm(nn.Module):
    exact = False  # the batch-invariant kernel (NativeModule.use_exact_kernels)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            from hybridflow.kernels.rms_norm import exact_rms_norm

            return exact_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def adjacent_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One [sum of rows, ...] tensor viewing `tensors` if they lie back to back in one storage."""
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    view = first.new_empty(0)
    view.set_(first.untyped_storage(), first.storage_offset(), (rows, *first.shape[1:]), first.stride())
    return view


def stacked(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) of one matmul computing all of `linears`, where their weights, and biases if any,
    lie back to back in one tensor (the engine's copy: engine/fused_decode.fuse_projections); else None."""
    weight = adjacent_rows([m.weight for m in linears])
    biases = [m.bias for m in linears]
    if weight is None or all(b is None for b in biases):
        return None if weight is None else (weight, None)
    bias = adjacent_rows(biases) if all(b is not None for b in biases) else None
    return None if bias is None else (weight, bias)


def project_group(linears: list[nn.Linear], x: torch.Tensor, exact: bool) -> list[torch.Tensor]:
    """Each of `linears` on x. Exact: one matmul where they are `stacked`, the outputs column views of
    it; an output column's bits do not depend on its neighbours, so this is the separate matmuls' result."""
    pair = stacked(linears) if exact else None
    if pair is not None:
        from hybridflow.kernels.linear import exact_linear

        return list(exact_linear(x, *pair).split([m.weight.shape[0] for m in linears], dim=-1))
    return [project(m, x, exact) for m in linears]


def project(linear: nn.Linear, x: torch.Tensor, exact: bool) -> torch.Tensor:
    """linear(x), or the same math through the batch-invariant matmul."""
    if exact:
        from hybridflow.kernels.linear import exact_linear

        return exact_linear(x, linear.weight, linear.bias)
    return linear(x)


def project_onto(linear: nn.Linear, x: torch.Tensor, residual: torch.Tensor, exact: bool) -> torch.Tensor:
    """residual + linear(x); exact: the add in the batch-invariant matmul's epilogue (the same sum)."""
    if exact:
        from hybridflow.kernels.linear import exact_linear

        return exact_linear(x, linear.weight, linear.bias, residual)
    return residual + linear(x)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class PackedLayout:
    """Sequence boundaries of a packed batch, computed once per forward (no host sync per layer)."""

    cu_seqlens: torch.Tensor  # [B + 1] int32 on the model's device
    bounds: list[int]  # the same on the host
    max_len: int
    sequence_parallel: object = None  # parallel.ulysses.SequenceParallel: attention over its group
    shared: object = None  # shared_prefix.SharedPrefix: prompts packed once for their responses
    # the exact kernels' view of the packed rows: kernels.packed_attention.PackedPages, or
    # kernels.shared_attention.SharedPages for a shared-prefix packing
    pages: object = None


@lru_cache(maxsize=1)
def _varlen_supports_gqa() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def packed_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout
) -> torch.Tensor:
    """Causal attention within each packed sequence. q [N, Hq, D], k/v [N, Hkv, D] -> [N, Hq, D].

    CUDA: PyTorch's built-in varlen flash attention. Elsewhere: SDPA per sequence (exact, no padding).
    A shared-prefix packing (`layout.shared`): responses also see their group's prompt."""
    if layout.pages is not None:  # batch-invariant: a token's bits as the engine computes them
        from hybridflow.kernels.packed_attention import exact_packed_attention

        return exact_packed_attention(q, k, v, layout.pages)
    if layout.shared is not None:
        from hybridflow.models.native.shared_prefix import shared_prefix_attention

        return shared_prefix_attention(q, k, v, layout)
    if q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        cu, n = layout.cu_seqlens, layout.max_len
        groups = q.shape[1] // k.shape[1]
        if groups > 1 and _varlen_supports_gqa():
            return varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0), enable_gqa=True)
        if groups > 1:  # older torch: expand the KV heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return varlen_attn(q, k, v, cu, cu, n, n, window_size=(-1, 0))
    # One split per input and one cat of the outputs: slicing per sequence (or writing slices of one
    # output) makes backward build a full-size gradient per sequence, quadratic in the sequences.
    bounds = layout.bounds
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:])]
    outs = []
    for qs, ks, vs in zip(*(torch.split(t, lengths) for t in (q, k, v))):
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (qs, ks, vs))  # [1, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))  # [L, Hq, D]
    return torch.cat(outs)


class Attention(nn.Module):
    exact = False  # projections through the batch-invariant matmul

    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * self.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_output_bias)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps) if c.qk_norm else None

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_store=None):
        """x [N, H] -> q [N, Hq, D], k and v [N, Hkv, D], RoPE applied (kv_store: see position)."""
        n = x.shape[0]
        q, k, v = project_group([self.q_proj, self.k_proj, self.v_proj], x, self.exact)
        q = q.view(n, self.heads, self.head_dim)
        k = k.view(n, self.kv_heads, self.head_dim)
        v = v.view(n, self.kv_heads, self.head_dim)
        return self.position(q, k, v, cos, sin, kv_store)

    def position(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_store=None,
    ):
        """The projections q [N, Hq, D], k and v [N, Hkv, D] -> q and k normed (Qwen3) and rotated.
        kv_store (the exact kernels): (k_cache, v_cache, slots [N]), an engine's cache layer: the rotated
        k and v go to its rows `slots` in the rotary's launch, and k comes back None."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if kv_store is not None and not self.exact:
            raise ValueError("Attention.position: kv_store is the exact kernels' (use_exact_kernels)")
        if self.exact:  # q and k in one launch (the same math, rounded the same way)
            from hybridflow.kernels.rope import exact_rope_qk

            store = None if kv_store is None else (*kv_store, v)
            return *exact_rope_qk(q, k, cos, sin, v.dtype, store), v
        cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, D]
        q = (q * cos + rotate_half(q) * sin).to(v.dtype)
        k = (k * cos + rotate_half(k) * sin).to(v.dtype)
        return q, k, v


class MLP(nn.Module):
    exact = False  # projections through the batch-invariant matmul

    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: torch.Tensor, *, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, H] -> [N, H]; with `residual` [N, H], residual + that (the block's add: the exact
        kernels add it in the down projection's epilogue)."""
        gate, up = project_group([self.gate_proj, self.up_proj], x, self.exact)
        if self.exact:  # one launch (the same math, rounded the same way)
            from hybridflow.kernels.swiglu import exact_silu_mul

            act = exact_silu_mul(gate, up)
        else:
            act = F.silu(gate) * up
        if residual is None:
            return project(self.down_proj, act, self.exact)
        return project_onto(self.down_proj, act, residual, self.exact)


def matmul_input_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a matmul under way casts its input to (autocast's), or None (the input's own)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class DecoderLayer(nn.Module):
    """Pre-norm block. The parts around attention are separate methods so that `torch.compile` can
    fuse their norms, RoPE and elementwise work while attention (whose sequence boundaries change
    every micro-batch) stays outside the compiled graphs."""

    def __init__(self, c: NativeConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        sparse = c.moe is not None and index in c.moe.sparse_layers
        self.mlp = SparseMoE(c.hidden_size, c.moe) if sparse else MLP(c)
        self.compiled: tuple | None = None  # (before_attention, after_attention) once compiled

    def before_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_store=None):
        """x [N, H] -> q, k, v (Attention.qkv; kv_store: the exact kernels' K/V store, see
        Attention.position)."""
        if self.self_attn.exact:  # the norm out in the QKV matmul's dtype (its cast, done in the norm)
            from hybridflow.kernels.rms_norm import exact_rms_norm

            norm = self.input_layernorm
            return self.self_attn.qkv(
                exact_rms_norm(x, norm.weight, norm.eps, matmul_input_dtype(x)), cos, sin, kv_store
            )
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin, kv_store)

    def after_attention(
        self, x: torch.Tensor, attn: torch.Tensor, routes: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [N, H] residual stream, attn [N, Hq, D] -> next residual stream [N, H]. routes [N, k]:
        an MoE layer's experts to replay per token (SparseMoE.forward); None elsewhere."""
        if self.self_attn.exact:  # the residual add and the norm in one launch, out in the matmul's dtype
            from hybridflow.kernels.rms_norm import exact_add_rms_norm

            o = project(self.self_attn.o_proj, attn.flatten(1), True)
            norm = self.post_attention_layernorm
            x, h = exact_add_rms_norm(x, o, norm.weight, norm.eps, matmul_input_dtype(x))
        else:
            x = x + project(self.self_attn.o_proj, attn.flatten(1), False)
            h = self.post_attention_layernorm(x)
        if self.sparse:
            return x + (self.mlp(h) if routes is None else self.mlp(h, routes))
        return self.mlp(h, residual=x)  # the block's add (exact: in the down projection's epilogue)

    def after_attention_routed(
        self, x: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An MoE layer's after_attention that also returns the experts each token went to [N, k]
        (the engine keeps them for router replay)."""
        x = x + self.self_attn.o_proj(attn.flatten(1))
        h = self.post_attention_layernorm(x)
        weights, chosen = self.mlp.route(h)
        return x + self.mlp.mix(h, weights, chosen), chosen

    def compile(self, **options) -> None:
        """Compile the parts around attention (dynamic in the token count)."""
        self.compiled = (
            torch.compile(self.before_attention, dynamic=True, **options),
            torch.compile(self.after_attention, dynamic=True, **options),
        )

    def forward(self, x, cos, sin, layout: PackedLayout, routes: torch.Tensor | None = None):
        before, after = self.compiled or (self.before_attention, self.after_attention)
        q, k, v = before(x, cos, sin)
        sp = layout.sequence_parallel
        if sp is not None:
            attn = sp.attention(q, k, v, layout, packed_causal_attention)
        else:
            attn = packed_causal_attention(q, k, v, layout)
        return after(x, attn) if routes is None else after(x, attn, routes)

    @property
    def sparse(self) -> bool:
        return isinstance(self.mlp, SparseMoE)


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm: packed tokens -> final hidden states."""

    def __init__(self, c: NativeConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gradient_checkpointing = False
        self.sequence_parallel = None  # set by parallel.ulysses.apply_sequence_parallel
        self.exact_kernels = False  # set by NativeModule.use_exact_kernels

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        shared: object = None,
        routes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, position_ids [N]; cu_seqlens [B + 1] int32 -> final hidden states [N, H].
        `shared`: the SharedPrefix of a shared-prefix packing (cu_seqlens then bound its segments).
        `routes` [N, sparse layers, k] int64: experts to replay per token and MoE layer, -1 where the
        router chooses (see SparseMoE.forward)."""
        sp, total = self.sequence_parallel, input_ids.shape[0]
        if shared is not None and sp is not None:
            raise ValueError("a shared-prefix packing cannot be split for sequence parallelism")
        if routes is not None and sp is not None:
            raise ValueError("router replay does not split its routes for sequence parallelism yet")
        if sp is not None:  # this rank keeps 1/P of the (padded) tokens: [n] each
            cu_seqlens = cu_seqlens.to(input_ids.device)
            input_ids, position_ids, cu_seqlens = sp.split(input_ids, position_ids, cu_seqlens)
            bounds = cu_seqlens.tolist()
        else:
            # read where the caller keeps them: boundaries handed over on the host cost no device sync
            # (one read back from the GPU waits for all queued work, e.g. the last micro-batch's backward)
            bounds = cu_seqlens.tolist()
            cu_seqlens = cu_seqlens.to(input_ids.device, non_blocking=True)
        x = self.embed_tokens(input_ids)  # [N, H] ([n, H] under sequence parallelism)
        layout = PackedLayout(
            cu_seqlens, bounds, max(b - a for a, b in zip(bounds[:-1], bounds[1:])), sp, shared
        )
        if self.exact_kernels:
            from hybridflow.kernels.packed_attention import packed_pages
            from hybridflow.kernels.shared_attention import shared_pages

            group = self.config.num_attention_heads // self.config.num_key_value_heads
            layout.pages = (
                packed_pages(bounds, group, x.device)
                if shared is None
                else shared_pages(bounds, shared.groups, group, x.device)
            )
        cos, sin = rope_cos_sin(self.config, position_ids, x.dtype)  # [N, D] each
        sparse = 0
        for layer in self.layers:
            layer_routes = None
            if routes is not None and layer.sparse:
                layer_routes, sparse = routes[:, sparse], sparse + 1  # [N, k]
            if self.gradient_checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, cos, sin, layout, layer_routes, use_reentrant=False
                )
            else:
                x = layer(x, cos, sin, layout, layer_routes)
        x = self.norm(x)
        return x if sp is None else sp.gather(x, total)


def exact_kernels_refusal(model: nn.Module) -> str | None:
    """What in `model` the exact kernels do not cover yet, in words; None when they cover it all."""
    backbone = model.model
    if any(layer.sparse for layer in backbone.layers):
        return "mixture-of-experts layers are not covered yet (their grouped expert matmuls split by load)"
    if any(layer.compiled is not None for layer in backbone.layers):
        return "the layers are compiled (torch.compile rounds its own way): leave compile off"
    if backbone.sequence_parallel is not None:
        return "sequence parallelism is not covered yet (attention over a group's slices)"
    for name, module in model.named_modules():
        if hasattr(module, "lora_A"):
            return f"LoRA adapters ({name}) are not covered yet: train the full model, or leave it off"
        mesh = getattr(getattr(module, "weight", None), "device_mesh", None)  # a DTensor's
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):  # (parallel.tensor.TP_MESH)
            return f"tensor-parallel weights ({name}) are not covered yet"
    return None


class NativeModule(nn.Module):
    """What every native model shares: a `model` backbone, checkpointing and compile switches."""

    model: Backbone

    @property
    def gradient_checkpointing(self) -> bool:
        return self.model.gradient_checkpointing

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:
        self.model.gradient_checkpointing = on

    def compile_layers(self, **options) -> None:
        if self.model.exact_kernels:
            raise ValueError("the exact kernels' layers are not compiled (torch.compile rounds its own way)")
        for layer in self.model.layers:
            layer.compile(**options)

    @property
    def exact_kernels(self) -> bool:
        return self.model.exact_kernels

    def use_exact_kernels(self) -> None:
        """Every matmul, norm and attention of the forward through the batch-invariant kernels
        (hybridflow/kernels): a token's log-prob the same bits in the trainer and in the engine
        (rollout.exact_logprobs). Raises ValueError naming what they do not cover yet."""
        problem = exact_kernels_refusal(self)
        if problem:
            raise ValueError(f"exact log-probs: {problem}")
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.exact = True
        self.model.exact_kernels = True

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        shared: object = None,
        routes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, position_ids [N]; cu_seqlens [B + 1] int32 -> final hidden states [N, H]
        (`shared`, `routes`: see Backbone.forward)."""
        return self.model(input_ids, position_ids, cu_seqlens, shared, routes)


class NativeCausalLM(NativeModule):
    """hidden_states(packed) -> [N, H]; logits via `lm_head`; log-probs via `native.logprobs`."""

    def __init__(self, config: NativeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        """Full logits [N, V] (tests, small inputs); training uses chunked log-probs instead."""
        return self.lm_head(self.hidden_states(input_ids, position_ids, cu_seqlens))
