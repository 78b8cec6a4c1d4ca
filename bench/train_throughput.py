"""Training throughput of the native model (packed, chunked log-probs; eager and with compiled
layers) vs transformers (padded), same sequences, same run; and peak memory of log-prob computation,
chunked vs naive.

    PYTHONPATH=. python bench/train_throughput.py --shape 0.5b --steps 4
Random-weight Qwen2.5-shaped models, bf16 autocast over fp32 master weights, fused AdamW.
Two padded baselines: `sorted` uses our first-fit-decreasing token-budget planner (similar lengths
share a micro-batch: the least padding a padded trainer can get); `data_order` takes a fixed number
of sequences per micro-batch in data order (budget / longest length), as TRL's
per_device_train_batch_size or verl without remove-padding do.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from rollout import SHAPES as ROLLOUT_SHAPES  # bench/ is the script's own directory
from transformers import AutoConfig, AutoModelForCausalLM

from hybridflow.batch import pack_sequences, plan_microbatches
from hybridflow.models.native import chunked_token_logprobs, from_hf_model

SHAPES = {
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),
}
# Qwen3-30B-A3B's layers, 4 of its 48: bench/rollout.py's shape (the head's tying is set below)
SHAPES["30b-a3b-4layers"] = {
    k: v for k, v in ROLLOUT_SHAPES["30b-a3b-4layers"].items() if k != "tie_word_embeddings"
}
PEAK_TFLOPS = 989.0  # H200 dense bf16 (spec sheet)


def config_for(shape: str):
    fields = dict(SHAPES[shape])
    return AutoConfig.for_model(
        fields.pop("model_type", "qwen2"),
        vocab_size=151936,
        tie_word_embeddings=shape == "0.5b",
        max_position_embeddings=32768,
        rope_theta=1e6,
        **fields,
    )


def active_params(model, cfg) -> float:
    """Parameters one token goes through: of an MoE layer's experts, top_k of num_experts."""
    share = cfg.num_experts_per_tok / cfg.num_experts if getattr(cfg, "num_experts", None) else 1.0
    return sum(p.numel() * (share if ".experts." in n else 1.0) for n, p in model.named_parameters())


def flops(n_params: int, lengths: list[int], cfg) -> float:
    """6 N tokens + causal attention (fwd+bwd): 6 * layers * hidden * sum(L^2) (QK^T and PV, halved by causality)."""
    return 6 * n_params * sum(lengths) + 6 * cfg.num_hidden_layers * cfg.hidden_size * sum(
        n * n for n in lengths
    )


def native_step(model, opt, micro_batches):
    for seqs in micro_batches:
        packed = pack_sequences(seqs)
        ids = packed.input_ids.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = model.hidden_states(ids, packed.position_ids.cuda(), packed.cu_seqlens.cuda())
            logp, _ = chunked_token_logprobs(hidden, model.lm_head.weight, torch.roll(ids, -1), chunk=4096)
        (-logp.sum() / ids.numel()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def hf_step(model, opt, micro_batches):
    for seqs in micro_batches:
        width = max(map(len, seqs))
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
        labels = ids.masked_fill(mask == 0, -100)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda()).loss
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(step, model, opt, batches, steps):
    step(model, opt, batches)  # warm-up (and compilation)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step(model, opt, batches)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated() / 2**30


def measure(step, model, batches, steps, tokens, work) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    try:
        t, mem = timed(step, model, opt, batches, steps)
    except torch.OutOfMemoryError:
        return {"error": f"out of memory at {sum(map(len, batches[0]))}-token micro-batches"}
    finally:
        del opt
        torch.cuda.empty_cache()
    return {
        "s_per_step": t,
        "tokens_per_s": tokens / t,
        "mfu": work / t / (PEAK_TFLOPS * 1e12),
        "peak_gib": mem,
    }


def logprob_memory(tokens: int, hidden: int = 1536, vocab: int = 151936) -> dict:
    """Peak extra memory of log-probs + backward at `tokens` tokens: naive log_softmax vs chunked."""
    out = {}
    for name in ("naive", "chunked"):
        torch.cuda.empty_cache()
        h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        t = torch.randint(0, vocab, (tokens,), device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if name == "naive":
            lp = torch.log_softmax((h @ w.T).float(), -1).gather(-1, t[:, None])[:, 0]
        else:
            lp, _ = chunked_token_logprobs(h, w, t, chunk=4096)
        lp.sum().backward()
        torch.cuda.synchronize()
        out[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        del h, w, t, lp
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=list(SHAPES), default="0.5b")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tokens-per-step", type=int, default=65536)
    parser.add_argument("--microbatch-tokens", type=int, default=16384)
    parser.add_argument(
        "--hf-microbatch-tokens",
        type=int,
        default=16384,
        help="budget of the padded baselines (padded tokens)",
    )
    parser.add_argument("--memory-tokens", type=int, default=32768)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled-layers run")
    parser.add_argument("--profile", action="store_true", help="print the native step's top CUDA kernels")
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    lengths = []
    while sum(lengths) < args.tokens_per_step:
        lengths.append(rng.randint(512, 4096))
    seqs = [[rng.randrange(151936) for _ in range(n)] for n in lengths]
    batches = [[seqs[i] for i in mb] for mb in plan_microbatches(lengths, args.microbatch_tokens)]
    cfg = config_for(args.shape)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").cuda()
    n_params = sum(p.numel() for p in hf.parameters())
    work = flops(active_params(hf, cfg), lengths, cfg)
    results = {
        "shape": args.shape,
        "params_m": n_params / 1e6,
        "active_params_m": active_params(hf, cfg) / 1e6,
        "tokens_per_step": sum(lengths),
        "sequences": len(seqs),
        "device": torch.cuda.get_device_name(),
    }

    native = from_hf_model(hf)
    # parity on this GPU (bf16 autocast, varlen flash attention vs transformers' padded SDPA)
    probe = seqs[0][:300], seqs[1][:200]
    packed = pack_sequences(list(probe))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ours = native(packed.input_ids.cuda(), packed.position_ids.cuda(), packed.cu_seqlens.cuda()).float()
        ref = hf(input_ids=torch.tensor([probe[0]]).cuda()).logits[0].float()
    results["parity_max_abs_logit_diff_bf16"] = (ours[:300] - ref).abs().max().item()
    del hf
    torch.cuda.empty_cache()

    tokens = sum(lengths)
    results["native"] = measure(native_step, native.train(), batches, args.steps, tokens, work)
    print(json.dumps(results), flush=True)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        opt = torch.optim.AdamW(native.parameters(), lr=1e-5, fused=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            native_step(native, opt, batches)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
        del opt
    if not args.no_compile:
        start = time.perf_counter()
        native.compile_layers()
        results["native_compiled"] = measure(native_step, native, batches, args.steps, tokens, work)
        results["native_compiled"]["compile_and_warmup_s"] = time.perf_counter() - start
        print(json.dumps(results), flush=True)
    del native
    torch.cuda.empty_cache()

    per_micro = max(1, args.hf_microbatch_tokens // max(lengths))
    padded_plans = {
        "sorted": [[seqs[i] for i in mb] for mb in plan_microbatches(lengths, args.hf_microbatch_tokens)],
        "data_order": [seqs[i : i + per_micro] for i in range(0, len(seqs), per_micro)],
    }
    for name, plan in padded_plans.items():
        hf = (
            AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
            .cuda()
            .train()
        )
        entry = measure(hf_step, hf, plan, args.steps, tokens, work)
        entry["padded_tokens"] = sum(len(mb) * max(map(len, mb)) for mb in plan)
        results[f"transformers_padded_{name}"] = entry
        del hf
        torch.cuda.empty_cache()
    best = max(
        [results[k] for k in ("native", "native_compiled") if k in results], key=lambda r: r["tokens_per_s"]
    )
    for name in padded_plans:
        base = results[f"transformers_padded_{name}"]
        if "tokens_per_s" in base:
            results[f"speedup_vs_padded_{name}"] = best["tokens_per_s"] / base["tokens_per_s"]
    results[f"logprob_peak_gib_at_{args.memory_tokens}_tokens"] = logprob_memory(args.memory_tokens)
    print(json.dumps(results, indent=1), flush=True)


if __name__ == "__main__":
    main()
