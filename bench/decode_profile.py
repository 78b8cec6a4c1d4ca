"""Where a small-batch decode step's time goes (issue #28): the engine decodes B sequences of a
random-weight Qwen2.5 shape; each batch size's decode runs are timed bare, then once under the torch
profiler, which reports the GPU's busy time per step (kernels, by name) against the wall time per
step (the rest is the GPU waiting for the host: launches, sampling, bookkeeping) and the host ops
that took longest.

    PYTHONPATH=. python bench/decode_profile.py --shape 0.5b --batch 1 --batch 64     # H200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from hybridflow.engine import Engine, EngineConfig
from hybridflow.rollout.sampling import SamplingParams

sys.path.insert(0, "bench")
from rollout import PEAK_BW, VOCAB, random_model  # noqa: E402


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def step_read_bytes(model) -> int:
    """What a decode step reads of the engine's weights: all of them, but of an embedding that is not
    also the LM head only a row per token (none counted)."""
    embed = model.model.embed_tokens.weight
    untied = embed is not model.lm_head.weight
    return weight_bytes(model) - (embed.numel() * embed.element_size() if untied else 0)


def decode_engine(model, batch: int, tokens: int, device, fused: bool, exact: bool = False) -> Engine:
    """An engine with `batch` sequences past their prefill, decoding up to `tokens` each."""
    config = EngineConfig(max_context_tokens=128 + tokens + 8, page_size=64, max_batch_sequences=max(batch, 8),
                          gpu_memory_utilization=0.3, fused_decode=fused, exact_logprobs=exact)  # fmt: skip
    engine = Engine(model, eos_token_ids=[], config=config, device=device)
    # kernels compiled, and the batch's graph captured (a first run of this size)
    engine.generate([[5] * 128] * batch, SamplingParams(max_tokens=16, seed=0))
    for i in range(batch):
        engine.add_request(
            f"r{i}", [7 + i % 100] * 128, SamplingParams(max_tokens=tokens, temperature=1.0, seed=i)
        )
    engine.step()  # the prefill
    return engine


def measure(
    model, batch: int, device, runs: int, fused: bool, host_profile: bool = False, exact=False
) -> dict:
    steps = runs * EngineConfig.decode_steps
    engine = decode_engine(model, batch, 2 * steps + 16, device, fused, exact)
    engine.step()  # a first decode run
    # steady state at both ends of the timing: each step ends reading its run, with the next one
    # launched ahead in flight (no sync: it would count a run outside the steps timed, or twice)
    t0 = time.perf_counter()
    for _ in range(runs):
        engine.step()
    bare_ms = 1e3 * (time.perf_counter() - t0) / steps
    host_top = None
    if host_profile:  # the host's own work per run, by function (cProfile: the GPU keeps running)
        import cProfile
        import pstats

        prof_host = cProfile.Profile()
        prof_host.enable()
        for _ in range(runs):
            engine.step()
        torch.cuda.synchronize()
        prof_host.disable()
        stats = pstats.Stats(prof_host)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:15]  # by own time
        host_top = {f"{f[0].split('/')[-1]}:{f[1]}({f[2]})": round(1e3 * v[2] / runs, 3) for f, v in rows}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(runs):
            engine.step()
        torch.cuda.synchronize()
        profiled_ms = 1e3 * (time.perf_counter() - t0) / steps
    kernels: dict[str, float] = defaultdict(float)
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] += e.device_time_total / 1e3  # ms
            launches += 1
    gpu_ms = sum(kernels.values()) / steps
    host = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    kv_bytes = (
        batch
        * (128 + steps)
        * 2
        * model.config.num_hidden_layers
        * model.config.num_key_value_heads
        * model.config.head_dim
        * 2
    )
    bound_ms = 1e3 * (step_read_bytes(engine.model) + kv_bytes) / PEAK_BW
    del engine
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "fused": fused,
        "exact_logprobs": exact,
        "ms_per_step": round(bare_ms, 3),
        "ms_per_step_profiled": round(profiled_ms, 3),
        "gpu_busy_ms_per_step": round(gpu_ms, 3),
        "kernels_per_step": round(launches / steps, 1),
        "memory_bound_ms": round(bound_ms, 3),
        "top_kernels_ms_per_step": {
            k[:90]: round(v / steps, 4) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
        },
        "top_host_ops_ms_per_step": {a.key[:60]: round(a.self_cpu_time_total / 1e3 / steps, 4) for a in host},
        "host_functions_ms_per_run": host_top,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--batch", type=int, action="append", help="repeatable (default 1 and 64)")
    ap.add_argument("--runs", type=int, default=8, help="decode runs timed per batch size")
    ap.add_argument(
        "--unfused",
        type=int,
        action="append",
        default=[],
        help="also measure this batch size with the trainer's modules (repeatable)",
    )
    ap.add_argument("--master", choices=["bf16", "fp32"], default="bf16", help="as in bench/rollout.py")
    ap.add_argument("--exact", action="store_true", help="the engine with exact_logprobs (its own kernels)")
    ap.add_argument("--host-profile", action="store_true", help="cProfile the host's work per decode run")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_profile measures the GPU: run it on the H200")
    device = torch.device("cuda")
    model = random_model(args.shape, device, torch.float32 if args.master == "fp32" else torch.bfloat16)
    report = {"device": torch.cuda.get_device_name(), "shape": args.shape, "vocab": VOCAB, "master": args.master,
              "weights_gib": round(weight_bytes(model) / 2**30, 3), "decode_steps_per_run": EngineConfig.decode_steps,
              "results": [measure(model, b, device, args.runs, True, args.host_profile, args.exact) for b in args.batch or [1, 64]]
              + [measure(model, b, device, args.runs, False) for b in args.unfused]}  # fmt: skip
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
