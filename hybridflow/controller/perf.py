"""Throughput metrics with verl's names: perf/throughput (tokens per second per device),
timing_per_token_ms/<phase>, perf/mfu/actor (model FLOPs utilisation of the actor update),
perf/cpu_memory_used_gb, and the generation rate perf/gen_tokens_per_s."""

from __future__ import annotations

import psutil
import torch

# dense bf16 peak FLOP/s of the accelerators MFU is reported for (their vendors' figures)
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}

# verl: response tokens for generation, all tokens for the passes over whole sequences
_PER_ALL_TOKENS = ("ref", "values", "old_log_prob", "adv", "update_critic", "update_actor")


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, when it is one we know (None elsewhere, e.g. CPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def training_flops(shape, sequence_lengths: list[int]) -> float:
    """Forward + backward FLOPs of one pass over the sequences: 6 x (parameters a token goes through,
    without the input embedding: an MoE layer's chosen experts only) per token, plus causal attention
    scores and values (6 x 2 x layers x heads x head_dim x length^2, halved by the mask)."""
    dense = 6 * (shape.active_params - (0 if shape.tied else shape.embedding)) * sum(sequence_lengths)
    attention = 6 * shape.layers * shape.heads * shape.head_dim * sum(n * n for n in sequence_lengths)
    return float(dense + attention)


def perf_metrics(
    times: dict[str, float],
    *,
    prompt_lengths: list[int],
    response_lengths: list[int],
    devices: int,
    shape=None,
    actor_passes: int = 1,
    peak: float | None = None,
) -> dict[str, float]:
    """`times`: timing_s by phase for one step; `actor_passes`: how often the update goes over the
    batch (ppo_epochs)."""
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    total, responses = sum(lengths), sum(response_lengths)
    out = {
        "perf/total_num_tokens": float(total),
        "perf/time_per_step": times["step"],
        "perf/throughput": total / times["step"] / devices,
        "perf/cpu_memory_used_gb": psutil.virtual_memory().used / 2**30,
    }
    if times.get("gen") and responses:
        out["perf/gen_tokens_per_s"] = responses / times["gen"]
        out["timing_per_token_ms/gen"] = 1000 * times["gen"] / responses
    for phase in _PER_ALL_TOKENS:
        if times.get(phase) and total:
            out[f"timing_per_token_ms/{phase}"] = 1000 * times[phase] / total
    if shape is not None and peak and times.get("update_actor"):
        flops = actor_passes * training_flops(shape, lengths)
        out["perf/mfu/actor"] = flops / times["update_actor"] / (peak * devices)
    return out
