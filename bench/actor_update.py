"""The actor's GRPO update alone, on the workload of bench/vs_trl (512 sequences of 200 prompt + 256
response tokens by default): seconds per update under several micro-batch budgets, eager and with
compiled layers, and optionally the top CUDA kernels of one update (and their total time).

    PYTHONPATH=. python bench/actor_update.py --shape 0.5b --variants 8192 29184 29184:compile --profile
    PYTHONPATH=. python bench/actor_update.py --exact --variants 29184    # the batch-invariant kernels

A variant is TOKENS[:compile]: the micro-batch token budget, and whether the layers are compiled
(compilation is one-way: compiled variants run after the eager ones). Random-weight Qwen2.5-shaped
model, fp32 master weights, bf16 autocast, fused AdamW, token-mean loss, on-policy (no old log-probs).
--exact: the model on the batch-invariant kernels (rollout.exact_logprobs' trainer; no compiled variants)."""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from bench.rollout import random_model
from hybridflow.batch import TrainingBatch, pad_ragged
from hybridflow.config.schema import ActorConfig
from hybridflow.models.native import NativeCausalLM
from hybridflow.roles.actor import Actor


def random_batch(sequences: int, prompt: int, response: int, vocab: int, group: int) -> TrainingBatch:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(sequences // group)]
    prompt_ids = [list(prompts[i // group]) for i in range(sequences)]
    response_ids = [[rng.randrange(vocab) for _ in range(response)] for _ in range(sequences)]
    mask = pad_ragged([[1.0] * response for _ in range(sequences)])  # [B, T]
    advantages = torch.randn(sequences, 1).expand(sequences, response) * mask  # [B, T]
    return TrainingBatch(prompt_ids, response_ids, mask, advantages=advantages.contiguous())


def timed_updates(actor: Actor, batch: TrainingBatch, repeats: int) -> float:
    actor.update(batch)  # warm-up (and compilation)
    synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        actor.update(batch)
    synchronize()
    return (time.perf_counter() - start) / repeats


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def logprob_parity(model: NativeCausalLM, tokens: int = 4096) -> dict:
    """Chunked log-probs (compiled on CUDA) vs log_softmax over the full float32 logits of the same
    bf16 matmul: largest differences of log-probs, entropies and the gradient wrt the hidden states."""
    from hybridflow.models.native import chunked_token_logprobs

    g = torch.Generator(device=model.lm_head.weight.device).manual_seed(0)
    weight = model.lm_head.weight.detach().to(torch.bfloat16)  # [V, H]
    hidden = torch.randn(tokens, weight.shape[1], device=weight.device, generator=g).bfloat16()
    targets = torch.randint(0, weight.shape[0], (tokens,), device=weight.device, generator=g)
    upstream = torch.randn(tokens, device=weight.device, generator=g)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    logits = (h1 @ weight.T).float()  # [N, V]
    log_probs = torch.log_softmax(logits, -1)
    naive = log_probs.gather(-1, targets[:, None])[:, 0]
    naive_entropy = -(log_probs.exp() * log_probs).sum(-1)
    (naive * upstream).sum().backward()
    logp, entropy = chunked_token_logprobs(h2, weight, targets)
    (logp * upstream).sum().backward()
    return {
        "logp_max_abs_diff": (logp - naive).abs().max().item(),
        "entropy_max_abs_diff": (entropy - naive_entropy).abs().max().item(),
        "grad_hidden_max_abs_diff": (h2.grad.float() - h1.grad.float()).abs().max().item(),
        "grad_hidden_max_abs": h1.grad.float().abs().max().item(),
    }


def profile_update(actor: Actor, batch: TrainingBatch, rows: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        actor.update(batch)
        torch.cuda.synchronize()
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"kernel time {device_us / 1e6:.3f} s", flush=True)
    print(events.table(sort_by="self_cuda_time_total", row_limit=rows), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b", choices=["0.5b", "1.5b"])
    p.add_argument("--sequences", type=int, default=512)
    p.add_argument("--group", type=int, default=8, help="samples per prompt (they share the prompt)")
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936, help="259: bench/repeatable_runs.py's byte tokenizer")
    p.add_argument("--variants", nargs="+", default=["8192", "29184", "29184:compile"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="top kernels of each variant's update")
    p.add_argument("--rows", type=int, default=25)
    p.add_argument("--exact", action="store_true", help="the batch-invariant kernels (use_exact_kernels)")
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script")
    p.add_argument("--parity-tokens", type=int, default=4096, help="tokens of the log-prob parity check")
    args = p.parse_args()
    torch.manual_seed(0)
    model = random_model(args.shape, args.device, torch.float32, args.vocab)  # fp32 master weights
    batch = random_batch(args.sequences, args.prompt, args.response, model.config.vocab_size, args.group)
    tokens = args.sequences * (args.prompt + args.response)
    if args.exact:
        if any(v.endswith(":compile") for v in args.variants):
            raise SystemExit("--exact: the exact kernels' layers are not compiled; name eager variants only")
        model.use_exact_kernels()
    print(json.dumps({"chunked_logprobs_vs_naive": logprob_parity(model, args.parity_tokens)}), flush=True)
    compiled = False
    for variant in sorted(args.variants, key=lambda v: v.endswith(":compile")):
        budget, _, flag = variant.partition(":")
        if flag == "compile" and not compiled:
            model.compile_layers()
            compiled = True
        config = ActorConfig(max_tokens_per_microbatch=int(budget), loss_agg_mode="token-mean")
        actor = Actor(model, config, total_steps=100, max_response_tokens=args.response, pad_token_id=0)
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = timed_updates(actor, batch, args.repeats)
        print(json.dumps({
            "variant": variant, "exact": args.exact, "update_s": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if args.device == "cuda" else None,
        }), flush=True)  # fmt: skip
        if args.profile:
            profile_update(actor, batch, args.rows)
        del actor
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
