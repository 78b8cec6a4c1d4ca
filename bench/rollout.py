"""Rollout throughput of the built-in engine vs transformers `generate`, in the same run.

    PYTHONPATH=. python bench/rollout.py --shape 0.5b                 # H200: 256 prompts x 8, 512 tokens
    PYTHONPATH=. python bench/rollout.py --shape 0.5b --heavy-tail    # lengths from ~500 stop tokens
    PYTHONPATH=. python bench/rollout.py --shape smollm2 --prompts 16 --n 4 --response 64   # this CPU
    VLLM_CPU_KVCACHE_SPACE=4 .venv-vllm/bin/python bench/rollout.py --shape smollm2 ... --hf-sequences 0 --vllm

Random-weight Qwen2.5-shaped models in bf16 (smollm2: the embedded model on CPU, fp32). Prompts of
128-512 random tokens; responses forced to `--response` tokens (no EOS), or with --heavy-tail a set of
stop tokens of probability ~1/300 per step (geometric lengths capped at 2048). Also reports the
rollout/trainer log-prob gap and where decode time goes (the weight update: bench/weight_update.py).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import compile_log
import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.models.native import NativeCausalLM, from_hf
from hybridflow.rollout.sampling import SamplingParams

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layers (128 experts, 8 active, 3.3B active of 30.5B), 4 of its 48: one GPU holds
    # them with the trainer's fp32 weights and Adam state
    "30b-a3b-4layers": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                            num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                            norm_topk_prob=True, mlp_only_layers=[], decoder_sparse_step=1,
                            tie_word_embeddings=False),
}  # fmt: skip
VOCAB = 151936
PEAK_FLOPS, PEAK_BW = 790e12, 4.3e12  # H200 bf16 GEMM and copy bandwidth, measured on this machine


def hf_config(shape: str, vocab: int = VOCAB):
    from transformers import AutoConfig

    shape = dict(SHAPES[shape])
    return AutoConfig.for_model(
        shape.pop("model_type", "qwen2"),
        vocab_size=vocab,
        max_position_embeddings=32768,
        rope_theta=1e6,
        **shape,
    )


def random_model(shape: str, device, dtype, vocab: int = VOCAB) -> NativeCausalLM:
    config = from_hf(hf_config(shape, vocab))
    with torch.device("meta"):
        model = NativeCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    return model.eval()


def active_matmul_params(model: NativeCausalLM) -> float:
    """The matmul parameters one token goes through (top_k of num_experts of an MoE layer's experts)."""
    c, total = model.config, 0.0
    for n, p in model.named_parameters():
        if "embed" in n or "norm" in n:
            continue
        total += p.numel() * (c.moe.top_k / c.moe.num_experts if ".experts." in n else 1.0)
    return total


def roofline_tokens_per_s(model: NativeCausalLM, avg_context: float) -> float:
    """Decode ceiling: 2 FLOPs per matmul parameter per token at peak (an MoE layer's active experts
    only), plus reading the context's KV."""
    c = model.config
    matmul_params = active_matmul_params(model)
    if c.tie_word_embeddings:
        matmul_params += c.vocab_size * c.hidden_size
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    return 1.0 / (2 * matmul_params / PEAK_FLOPS + avg_context * kv_bytes / PEAK_BW)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=[*SHAPES, "smollm2"], default="0.5b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--heavy-tail", action="store_true")
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument(
        "--hf-sequences", type=int, default=256, help="sequences in the transformers run (0: skip it)"
    )
    ap.add_argument("--hf-response", type=int, default=128)
    ap.add_argument("--no-graphs", action="store_true")
    ap.add_argument("--compile", action="store_true", help="torch.compile the layers around attention")
    ap.add_argument("--decode-steps", type=int, default=EngineConfig.decode_steps, help="per host sync")
    ap.add_argument("--profile", action="store_true", help="where a decode step's time goes")
    ap.add_argument(
        "--timeline", action="store_true",
        help="drive the engine step by step: seconds in prefill, in decode by batch size, in graph capture",
    )  # fmt: skip
    ap.add_argument(
        "--unfused", action="store_true", help="decode with the trainer's modules (no fused step)"
    )
    ap.add_argument(
        "--master", choices=["bf16", "fp32"], default="bf16",
        help="the model's dtype: bf16 (the engine runs it as is) or fp32 (the trainer's master weights: "
        "the engine keeps a bf16 copy with fused projections)",
    )  # fmt: skip
    ap.add_argument(
        "--vllm", action="store_true", help="also time the vllm backend (vllm-cpu: make test-vllm's env)"
    )
    ap.add_argument(
        "--exact", action="store_true",
        help="rollout.exact_logprobs: the batch-invariant kernels (the gap is then to the trainer's exact kernels)",
    )  # fmt: skip
    ap.add_argument(
        "--record-routes", action="store_true",
        help="MoE shapes: the engine keeps every token's experts (router replay R3); the log-prob gap is "
        "then measured with the trainer replaying them too",
    )  # fmt: skip
    args = ap.parse_args()
    if args.exact and args.master != "fp32":  # (a bf16 model would be shared, its residual stream bf16)
        ap.error(
            "--exact matches the trainer of an fp32 master (its residual stream in fp32): add --master fp32"
        )
    rng = random.Random(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.shape == "smollm2":
        from hybridflow.models import load_causal_lm

        model, _ = load_causal_lm("default", impl="native")
        vocab = model.config.vocab_size
    else:
        dtype = torch.float32 if args.master == "fp32" else torch.bfloat16
        model, vocab = random_model(args.shape, device, dtype), VOCAB
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(128, 512))] for _ in range(args.prompts)]
    stops = rng.sample(range(vocab), vocab // 300) if args.heavy_tail else []
    max_tokens = 2048 if args.heavy_tail else args.response
    context = 512 + max_tokens + 1
    config = EngineConfig(
        max_batch_sequences=args.max_batch,
        max_context_tokens=context,
        page_size=64 if cuda else 16,
        gpu_memory_utilization=0.8,
        kv_cache_tokens=None if cuda else (args.prompts * args.n + 1) * context,  # (+1: the null page)
        cuda_graphs=not args.no_graphs,
        decode_steps=args.decode_steps,
        compile_layers=args.compile,
        fused_decode=not args.unfused,
        record_routes=args.record_routes,
        exact_logprobs=args.exact,
    )
    engine = Engine(model, eos_token_ids=[], config=config, device=device)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=max_tokens, stop_token_ids=stops, seed=0)
    result = {"shape": args.shape, "device": torch.cuda.get_device_name() if cuda else "cpu",
              "prompts": args.prompts, "n": args.n, "max_tokens": max_tokens, "heavy_tail": args.heavy_tail,
              "kv_cache_pages": engine.num_pages, "max_batch": args.max_batch,
              "decode_steps": args.decode_steps, "compile": args.compile, "master": args.master,
              "fused_decode": engine.runner.fused is not None, "record_routes": args.record_routes, "exact": args.exact}  # fmt: skip

    # The warm-up runs the timed workload's shapes (prompts of the same lengths, other tokens: no prefix
    # cache hits; the same samples; 16 tokens): its prefill's tiles and decode batches compile and capture
    # here, as a training run's first step does, not inside the timed run. Each compile is logged with
    # the part it fell in (1: warm-up, 2: the timed run)
    part, compiles = [1], Path(tempfile.mkdtemp()) / "compiles.jsonl"
    if cuda:
        compile_log.install(compiles, lambda: part[0])
    warm_rng = random.Random(1)
    warm = [[warm_rng.randrange(vocab) for _ in p] for p in prompts]
    start = time.perf_counter()
    engine.generate(warm, SamplingParams(n=args.n, temperature=1.0, max_tokens=16, seed=1))
    result["warmup_and_capture_s"] = time.perf_counter() - start
    part[0] = 2
    start = time.perf_counter()
    out = engine.generate(prompts, params) if not args.timeline else _stepped(engine, prompts, params, result)
    seconds = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in out)
    lengths = [len(g.token_ids) for g in out]
    avg_context = sum(len(prompts[g.prompt_index]) + len(g.token_ids) / 2 for g in out) / len(out)
    result["native"] = {
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "mean_len": tokens / len(out),
        "max_len": max(lengths),
        "steps": engine.stats.get("steps"),
        "preemptions": engine.stats.get("preemptions"),
        "graph_capture_seconds": engine.stats.get("graph_capture_seconds"),
    }
    if cuda:
        result["native"]["triton_compiles"] = compile_log.summary(compiles)  # (those in the timed run)
        result["native"]["roofline_tokens_per_s"] = roofline_tokens_per_s(engine.model, avg_context)
        result["native"]["roofline_fraction"] = (
            result["native"]["tokens_per_s"] / result["native"]["roofline_tokens_per_s"]
        )
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(result), flush=True)

    if cuda:  # free the KV pool for the measurements below
        engine.sleep()
        torch.cuda.empty_cache()
        result["after_sleep_memory_gib"] = torch.cuda.memory_allocated() / 2**30
    # rollout vs trainer log-probs on sampled sequences (the trainer: fp32 master weights, autocast)
    from hybridflow.roles.forward import packed_response_logprobs

    sample = out[: min(64, len(out))]
    # (an fp32 model is the trainer's master itself; the engine ran its own bf16 copy)
    master = model if args.master == "fp32" or not cuda else _fp32_master(engine.model)
    if args.exact and not master.exact_kernels:
        master.use_exact_kernels()
    replays = {"logprob_gap_vs_trainer": None}
    if args.record_routes:  # the same sequences with the trainer routing as the engine did
        replays["logprob_gap_vs_trainer_replayed"] = [g.routed_experts for g in sample]
    for key, routes in replays.items():
        with torch.no_grad():
            trainer_lp, _ = packed_response_logprobs(
                master, [prompts[g.prompt_index] for g in sample], [g.token_ids for g in sample],
                device=device, compute_dtype="auto", routes=routes,
            )  # fmt: skip
        gaps = torch.cat(
            [
                (trainer_lp[i, : len(g.token_ids)].cpu() - torch.tensor(g.unscaled_logprobs).float()).abs()
                for i, g in enumerate(sample)
            ]
        )
        result[key] = {"tokens": gaps.numel(), "max": gaps.max().item(), "mean": gaps.mean().item(),
                       "equal_tokens": int((gaps == 0).sum())}  # fmt: skip
    del master

    if cuda and args.profile:
        engine.wake()
        step_s = seconds / result["native"]["steps"]
        result["decode_breakdown"] = _breakdown(
            engine, min(args.max_batch, args.prompts * args.n), 576, step_s
        )
        engine.sleep()
        torch.cuda.empty_cache()
    # transformers generate on a subset, same model weights
    if args.hf_sequences:
        result["transformers"] = _hf_generate(engine.model if cuda else model, prompts, args, device, vocab)
        result["speedup_vs_transformers"] = (
            result["native"]["tokens_per_s"] / result["transformers"]["tokens_per_s"]
        )
    if args.vllm:
        result["vllm"] = _vllm_generate(prompts, args, max_tokens)
        result["speedup_vs_vllm"] = result["native"]["tokens_per_s"] / result["vllm"]["tokens_per_s"]
    print(json.dumps(result, indent=1), flush=True)


def _stepped(engine: Engine, prompts, params: SamplingParams, result: dict):
    """engine.generate's work through the request API, each step timed (every step ends in a sync):
    prefill steps, decode runs by batch size, graph capture. -> generations, as generate's."""
    from hybridflow.rollout.sampling import Generation

    for i, prompt in enumerate(prompts):  # the noise streams generate gives them
        engine.add_request(str(i), prompt, replace(params, first_sequence=i * params.n))
    tokens: dict[tuple, list] = {}
    timeline: dict[str, list] = {}  # kind -> [steps, seconds, tokens]
    captured = engine.runner.capture_seconds
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        outs = engine.step()
        seconds = time.perf_counter() - start
        new = [len(o.token_ids) for o in outs]
        if new and max(new) == 1:  # a prefill draws one token per sequence (a decode run: up to 8)
            kind = "prefill"
        else:
            kind = next(f"decode, batch <= {b}" for b in (8, 64, 256, 1 << 30) if len(outs) <= b)
        entry = timeline.setdefault(kind, [0, 0.0, 0])
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + seconds, entry[2] + sum(new)
        for o in outs:
            got = tokens.setdefault((int(o.request_id), o.sample), ([], []))
            got[0].extend(o.token_ids)
            got[1].extend(o.unscaled_logprobs)
    result["timeline"] = {
        k: {"steps": v[0], "seconds": round(v[1], 3), "tokens": v[2]} for k, v in timeline.items()
    }
    result["timeline"]["graph capture seconds (inside the steps)"] = engine.runner.capture_seconds - captured
    return [Generation(i, t, u, "", u) for (i, _), (t, u) in sorted(tokens.items())]


def _vllm_generate(prompts, args, max_tokens: int) -> dict:
    """The vllm backend on the same prompts and workload (smollm2: the cached HF directory)."""
    from hybridflow.models.default import default_model_dir
    from hybridflow.rollout.vllm import VLLMBackend

    if args.shape != "smollm2":
        raise SystemExit("--vllm compares on the embedded model (--shape smollm2)")
    backend = VLLMBackend(
        str(default_model_dir()), eos_token_ids=[], max_model_len=512 + max_tokens + 1, dtype="float32"
    )
    return _timed_generate(backend, prompts, SamplingParams(n=args.n, max_tokens=max_tokens, seed=0))


def _timed_generate(backend, prompts, params: SamplingParams) -> dict:
    """Output tokens/s of one generate call, after a short warm-up call."""
    backend.generate(prompts[:1], SamplingParams(n=1, max_tokens=4))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = backend.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in out)
    return {
        "sequences": len(out),
        "output_tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
    }


def _timed(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def _breakdown(engine: Engine, batch: int, context: int, step_s: float) -> dict:
    """Where a decode step's time goes at `batch` sequences of `context` tokens: the captured decode
    graph (GEMMs + attention + the rest), the Triton attention kernel alone (all layers), the
    sampler, and host time (the engine's measured step time minus the GPU parts)."""
    from hybridflow.engine.sampler import step_keys
    from hybridflow.engine.triton_decode import paged_decode_attention_triton
    from hybridflow.engine.triton_sampler import sample_triton

    runner, c = engine.runner, engine.model.config
    pages = -(-context // runner.page_size)
    table = (
        torch.arange(batch * pages, dtype=torch.int32, device="cuda").view(batch, pages)
        % (engine.num_pages - 1)
        + 1
    )
    runner._capture(batch)
    st = runner.static
    st["ids"][:batch].random_(0, c.vocab_size)
    st["pos"][:batch] = context - 1
    st["ctx"][:batch] = context
    st["table"][:batch, :pages] = table
    st["slots"][:batch] = table[:, -1].long() * runner.page_size
    graph, logits = runner.graphs[batch]
    graph_s = _timed(graph.replay)
    q = torch.randn(batch, c.num_attention_heads, c.head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = engine.cache.k[0], engine.cache.v[0]
    attn_s = c.num_hidden_layers * _timed(
        lambda: paged_decode_attention_triton(
            q, k, v, st["table"][:batch], st["ctx"][:batch], runner.page_size
        )
    )
    keys = step_keys(torch.arange(batch, device="cuda"), torch.zeros(batch, dtype=torch.int64, device="cuda"))
    sample_s = _timed(lambda: sample_triton(logits[:batch], 1.0, keys))
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * batch * context
    return {
        "batch": batch,
        "context": context,
        "step_ms": step_s * 1e3,
        "decode_graph_ms": graph_s * 1e3,
        "attention_ms": attn_s * 1e3,
        "attention_tb_per_s": kv_bytes / attn_s / 1e12,
        "gemm_and_rest_ms": (graph_s - attn_s) * 1e3,
        "sampling_ms": sample_s * 1e3,
        "host_ms": max(step_s - graph_s - sample_s, 0.0) * 1e3,
    }


def _fp32_master(model: NativeCausalLM) -> NativeCausalLM:
    with torch.device("meta"):
        master = NativeCausalLM(model.config)
    master = master.to_empty(device=next(model.parameters()).device).float()
    if model.config.tie_word_embeddings:
        master.lm_head.weight = master.model.embed_tokens.weight
    master.load_state_dict(model.state_dict())
    return master.eval()


def _hf_generate(model: NativeCausalLM, prompts, args, device, vocab) -> dict:
    from hybridflow.rollout.hf import HFBackend

    hf_conf = hf_config(args.shape) if args.shape != "smollm2" else None
    if hf_conf is None:
        from hybridflow.models import load_causal_lm

        hf, _ = load_causal_lm("default", impl="hf")
    else:
        from transformers import AutoModelForCausalLM

        with torch.device(device):
            hf = AutoModelForCausalLM.from_config(hf_conf, dtype=torch.bfloat16)
        hf.load_state_dict(model.state_dict(), strict=False)  # the same weights
    hf.eval()
    n_prompts = max(1, args.hf_sequences // args.n)
    backend = HFBackend(hf, pad_token_id=0, eos_token_ids=[vocab + 1], max_batch_sequences=args.hf_sequences)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.hf_response, seed=0)
    return _timed_generate(backend, prompts[:n_prompts], params)


if __name__ == "__main__":
    main()
