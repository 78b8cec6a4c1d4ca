"""The engine's settings (EngineConfig) and the CPU pool's size."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.engine.drafter import SpeculativeConfig


def page_size_for(device) -> int:
    """Tokens a KV page holds on `device`, decided here alone: 64 on CUDA (the decode kernel's token
    blocks), 16 elsewhere (a CPU's small batches waste less of a last page)."""
    return 64 if device.type == "cuda" else 16


def pool_tokens_for(sequences: int, context_tokens: int, page_size: int) -> int:
    """A KV pool that holds `sequences` whole sequences of `context_tokens` at once (each in whole
    pages), plus the one page the scheduler keeps spare: the CPU's pool, sized to a step."""
    return (sequences * -(-context_tokens // page_size) + 1) * page_size


@dataclass
class EngineConfig:
    max_batch_sequences: int = 256
    """Most sequences decoded together (and the largest captured CUDA graph)."""
    max_prefill_tokens: int = 16384
    """Token budget of one prefill step (a longer prompt is prefilled alone)."""
    max_context_tokens: int = 4096
    """Longest prompt + response; a sequence that reaches it stops with finish_reason 'length'."""
    page_size: int | None = None
    """Tokens a KV page holds; None: by device (page_size_for), which is what every caller wants."""
    kv_cache_tokens: int | None = None
    """Size of the KV pool in tokens; by default `gpu_memory_utilization` of the free GPU memory (at
    most room for max_batch_sequences at full context), or that room on CPU."""
    gpu_memory_utilization: float = 0.5
    cuda_graphs: bool = True
    decode_steps: int = 8
    """Decode steps the device runs between two looks of the host: the host plans and records once per
    run while the GPU works on (a sequence that stops in a run computes to its end, at most this many
    steps more; 1: a host round trip per token)."""
    compile_layers: bool = False
    """torch.compile the parts of each layer around attention (fused norms, RoPE, SwiGLU)."""
    fused_decode: bool = True
    """On CUDA, run the fused layers (engine/fused_decode.py: nine kernels a layer where the trainer's
    modules launch ~45) in prefill and decode, and a decode step's draw and record inside its graph;
    on CPU in fp32, the trainer's modules with their matmuls on oneDNN-packed weights
    (engine/cpu_layers.py, 2-4x MKL's matmuls); False: the trainer's modules as they are."""
    compute_dtype: str = "auto"
    """'auto': bfloat16 on CUDA, the model's own dtype elsewhere."""
    progress: bool = False
    """A transient bar of finished sequences during `generate` (on a terminal only)."""
    prefix_cache: bool = True
    """Keep the K/V of full pages after their requests end, keyed by their token prefix, so a prompt
    that extends an earlier one (a conversation's next turn, a shared system prompt) prefills only
    what is new; dropped at every update_weights and sleep."""
    keep_kv_on_weight_update: bool = False
    """A weight update leaves the sequences in flight the K/V they have (computed with the older
    weights) instead of prefilling them again: no recomputation, and tokens sampled with the new
    weights attend to older K/V (PipelineRL's in-flight updates). Such K/V never enter the prefix
    cache; a sequence preempted for room is recomputed with the weights of the time."""
    share_weights: bool = True
    """Run the trainer's module itself when device and dtype match (no copy, nothing to update);
    False keeps a copy (the trainer's module is about to be sharded)."""
    exact_logprobs: bool = False
    """Every forward through the batch-invariant kernels (hybridflow/kernels) that the trainer runs too,
    and each sampled token's log-prob from the trainer's softmax kernel: equal to the trainer's to the
    bit (plain temperature sampling; top-k / top-p report the truncated distribution's). The model's
    own layers, nothing fused or compiled; CUDA only (and Triton's interpreter, for tests)."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding from the engine's own history (engine/drafter.py): while few sequences run,
    each step checks a sequence's drafted tokens in one forward and keeps those the plain engine would
    have drawn, then one more; the tokens and log-probs are the plain engine's (the same noise at the
    same position), only fewer forwards."""
    record_routes: bool = False
    """Mixture-of-experts models: keep the experts every token went to in every MoE layer and hand
    them out with each finished sample (`routed_experts`), for router replay (R3) in the trainer."""
