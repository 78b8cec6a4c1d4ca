"""Where the actor update's peak GPU memory goes, against the memory plan's estimate of it: a random
Qwen2.5-shaped model (fp32 master weights, bf16 autocast, Adam), tied or untied LM head, a GRPO update
on a GSM8K-like batch; the live tensors at the peak of the second update (Adam's state allocated),
summed by the first hybridflow frame that allocated them.

    PYTHONPATH=. python bench/update_memory.py --shape 1.5b --untied --budget 8192

The plan's update_actor for a colocated run adds the reference, the engine and the CUDA context to
what is measured here (actor weights, gradients, Adam, activations, the log-prob chunks)."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from bench.actor_update import random_batch
from bench.rollout import hf_config
from hybridflow.config.schema import ActorConfig
from hybridflow.models.native import NativeCausalLM
from hybridflow.models.native.config import from_hf
from hybridflow.plan.memory import (
    GIB,
    LOGPROB_CHUNK,
    ModelShape,
    _activations,
    head_backward_bytes,
)
from hybridflow.roles.actor import Actor


def model_of(shape: str, tied: bool) -> tuple[NativeCausalLM, ModelShape]:
    hf = hf_config(shape)
    hf.tie_word_embeddings = tied
    with torch.device("meta"):
        model = NativeCausalLM(from_hf(hf))
    model = model.to_empty(device="cuda").float()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return model, ModelShape.from_hf_config(hf)


def peak_live_by_frame(snapshot: dict, top: int) -> tuple[int, list[tuple[str, float]]]:
    """Replay the allocator's trace: the bytes live at the highest point, by the first hybridflow
    frame (file:line function) of each block's allocation."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for trace in snapshot["device_traces"]:
        for event in trace:
            if event["action"] == "alloc":
                frame = next(
                    (f"{f['filename'].split('hybridflow/')[-1]}:{f['line']} {f['name']}"
                     for f in event.get("frames", []) if "hybridflow/" in f["filename"]),
                    "(outside hybridflow)",
                )  # fmt: skip
                live[event["addr"]] = (event["size"], frame)
                total += event["size"]
                if total > peak:
                    peak, at_peak = total, dict(live)
            elif event["action"] == "free_completed" and event["addr"] in live:
                total -= live.pop(event["addr"])[0]
    by_frame: dict[str, int] = defaultdict(int)
    for size, frame in at_peak.values():
        by_frame[frame] += size
    ranked = sorted(by_frame.items(), key=lambda kv: -kv[1])[:top]
    return peak, [(frame, round(size / GIB, 3)) for frame, size in ranked]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b", choices=["0.5b", "1.5b"])
    p.add_argument("--untied", action="store_true")
    p.add_argument("--budget", type=int, default=8192, help="micro-batch tokens")
    p.add_argument("--sequences", type=int, default=256)
    p.add_argument("--prompt", type=int, default=150)
    p.add_argument("--response", type=int, default=300)
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    torch.manual_seed(0)
    model, shape = model_of(args.shape, tied=not args.untied)
    batch = random_batch(args.sequences, args.prompt, args.response, shape.vocab, 8)
    config = ActorConfig(max_tokens_per_microbatch=args.budget, loss_agg_mode="token-mean")
    actor = Actor(model, config, total_steps=100, max_response_tokens=args.response, pad_token_id=0)
    actor.update(batch)  # Adam's state is made at the first step
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    actor.update(batch)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated()
    replayed, frames = peak_live_by_frame(snapshot, args.top)
    logits = 2 * LOGPROB_CHUNK * shape.vocab * 2
    planned = (
        16 * shape.params + _activations(shape, args.budget, False) + logits + head_backward_bytes(shape)
    )
    print(json.dumps({
        "shape": args.shape, "tied": not args.untied, "params": shape.params, "budget": args.budget,
        "resident_before_gib": round(before / GIB, 2), "peak_gib": round(measured / GIB, 2),
        "planned_gib": round(planned / GIB, 2), "new_at_peak_gib": round(replayed / GIB, 2),
        "new_at_peak_by_frame": frames,
    }, indent=1), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
