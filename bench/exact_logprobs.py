"""rollout.exact_logprobs on a GPU: do the batch-invariant kernels hold their promise there, and what
do they cost? One process, every figure beside its baseline from the same run:

  kernels   each matmul shape of the 0.5B/1.5B/7B Qwen2.5 layers: a row's bits alone, in 3, 16, 64,
            65, 300 and 4096 rows (cuBLAS beside it); its time against cuBLAS at 1, 64 and 4096 rows;
            attention: a decode query (one chunk program or split chunks) against the same query in
            a packed prefill; time against flash attention (varlen) and the engine's decode kernel
  engine    a random 0.5B-shaped model (fp32 master, the engine's bf16 copy, as in training): tokens/s
            at --sequences sequences and at batch 1, exact and ordinary, and generation as a
            synchronous GRPO step runs it (woken, 16 prompts x 8, lengths spread by stop tokens:
            seconds, graph captures); every sampled token's log-prob against the trainer's packed
            forward (exact: the trainer on the exact kernels)
  training  packed forward + backward (chunked LM-head log-probs, bf16 autocast over fp32 weights):
            tokens/s exact and ordinary
  profile   the same step under torch's profiler, exact and ordinary, with and without the
            deterministic settings: GPU time, launches, the longest kernels

    PYTHONPATH=.:bench python bench/exact_logprobs.py --out exact.json [--sections kernels,engine,training]
A section that fails records its error and the others still run."""

# ruff: noqa: B023 (each closure is timed at once, inside its loop iteration)
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import traceback
from dataclasses import replace

import torch
import torch.nn.functional as F
from rollout import SHAPES, _fp32_master, random_model  # bench/ is the script's own directory

from hybridflow.engine import Engine, EngineConfig
from hybridflow.kernels.attention import Tiles, paged_attention
from hybridflow.kernels.linear import linear
from hybridflow.kernels.packed_attention import exact_packed_attention, packed_pages
from hybridflow.rollout.sampling import SamplingParams


def _time(fn, repeat: int = 20) -> float:
    """Median seconds of fn() on the GPU."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def smoke() -> dict:
    """Each kernel once on small inputs (a compile error shows here whole)."""
    from hybridflow.kernels.rms_norm import rms_norm
    from hybridflow.kernels.rope import rope

    out = {}
    x = torch.randn(3000, 4864, device="cuda", dtype=torch.bfloat16)
    out["linear"] = True  # a row's bits in 1-300 rows (pointer loads, split chunks) as in 3,000 (TMA)
    for k, n in ((896, 1152), (4864, 896), (896, 9728)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        full = linear(x[:, :k].contiguous(), w)
        out["linear"] &= all(
            torch.equal(linear(x[:m, :k].contiguous(), w), full[:m]) for m in (1, 3, 16, 64, 65, 300)
        )
    x = x[:100, :896].contiguous()
    out["rms_norm"] = bool(rms_norm(x.float(), torch.ones(896, device="cuda"), 1e-6).isfinite().all())
    q = torch.randn(100, 14, 64, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(100, 64, device="cuda"), torch.randn(100, 64, device="cuda")
    out["rope"] = bool(rope(q, cos, sin, torch.bfloat16).isfinite().all())
    k = torch.randn(100, 2, 64, device="cuda", dtype=torch.bfloat16)
    pages = packed_pages([0, 60, 100], 7, "cuda")
    packed = paged_attention(q, k, k, pages.table, 1, pages.tiles)
    ctx = torch.tensor([60, 40], device="cuda")
    out["attention"] = all(  # a decode step's tiles of 16 rows against the packed forward's 64
        torch.equal(paged_attention(q[[59, 99]], k, k, pages.table, 1, Tiles.of_decode(ctx), split=split),
                    packed[[59, 99]]) for split in (True, False)
    )  # fmt: skip
    # the backward: twice the same bits, and near flash attention's
    from hybridflow.models.native.model import PackedLayout, packed_causal_attention

    inputs = [t.clone().requires_grad_() for t in (q, k, torch.randn_like(k))]
    grad = torch.randn_like(q)
    first, second = (torch.autograd.grad(exact_packed_attention(*inputs, pages), inputs, grad) for _ in "ab")
    layout = PackedLayout(torch.tensor([0, 60, 100], device="cuda", dtype=torch.int32), [0, 60, 100], 60)
    flash = torch.autograd.grad(packed_causal_attention(*inputs, layout), inputs, grad)
    out["attention_backward_repeats"] = all(torch.equal(a, b) for a, b in zip(first, second))
    out["attention_backward_vs_flash_relative"] = [
        ((a.float() - f.float()).norm() / f.float().norm()).item() for a, f in zip(first, flash)
    ]
    return out


def kernels() -> dict:
    out = {"linear": {}, "attention": {}}
    shapes = set()
    for name in ("0.5b", "1.5b", "7b"):
        s = SHAPES[name]
        h, i = s["hidden_size"], s["intermediate_size"]
        q = h + 2 * s["num_key_value_heads"] * (h // s["num_attention_heads"])
        shapes |= {(h, q), (h, h), (h, 2 * i), (i, h)}
    shapes.add((896, 151936))  # the LM head
    torch.manual_seed(0)
    for k, n in sorted(shapes):
        x = torch.randn(4096, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        full = linear(x, w)
        row = {"invariant": all(torch.equal(linear(x[:m].contiguous(), w), full[:m]) for m in (1, 3, 16, 64, 65, 300)),
               "cublas_invariant": all(torch.equal(F.linear(x[:m], w), F.linear(x, w)[:m]) for m in (1, 3, 16, 64, 65, 300)),
               "max_err_vs_fp32": (full.float() - x.float() @ w.float().T).abs().max().item()}  # fmt: skip
        for m in (1, 64, 4096):
            xs = x[:m].contiguous()
            exact, cublas = _time(lambda: linear(xs, w)), _time(lambda: F.linear(xs, w))
            row[f"m{m}_us"] = {"exact": exact * 1e6, "cublas": cublas * 1e6, "ratio": exact / cublas}
        out["linear"][f"{k}x{n}"] = row
    # attention: packed sequences of the 0.5B and 7B shapes' heads
    from hybridflow.engine.triton_decode import paged_decode_attention_triton
    from hybridflow.models.native.model import PackedLayout, packed_causal_attention

    for heads, kv_heads, dim in ((14, 2, 64), (28, 4, 128)):
        lens = [1000, 37, 513, 2048, 700]
        bounds = [0]
        for length in lens:
            bounds.append(bounds[-1] + length)
        n = bounds[-1]
        q = torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        pages = packed_pages(bounds, heads // kv_heads, "cuda")
        table, tiles = pages.table, pages.tiles
        packed = paged_attention(q, k, v, table, 1, tiles)
        cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
        layout = PackedLayout(cu, bounds, max(lens))

        def flash():  # the trainer's ordinary attention (varlen flash, GQA as this torch has it)
            return packed_causal_attention(q, k, v, layout)

        ref = flash()
        # the decode form: each sequence's query at a few positions, through a paged copy (page 64)
        page = 64
        pages = [-(-length // page) for length in lens]
        order = torch.randperm(sum(pages)) + 1
        k_cache = torch.zeros((sum(pages) + 1) * page, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        page_table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device="cuda")
        at = 0
        for b, length in enumerate(lens):
            ids = order[at : at + pages[b]].cuda()
            page_table[b, : pages[b]] = ids.int()
            slots = (ids[:, None] * page + torch.arange(page, device="cuda")).flatten()[:length]
            k_cache[slots], v_cache[slots] = k[bounds[b] : bounds[b + 1]], v[bounds[b] : bounds[b + 1]]
            at += pages[b]
        same = True
        for back in (1, 2, 100, 511):
            ctx = torch.tensor([max(length - back, 1) for length in lens], device="cuda")
            rows = torch.tensor([b0 + c - 1 for b0, c in zip(bounds[:-1], ctx.tolist())], device="cuda")
            for split in (False, True):
                got = paged_attention(
                    q[rows], k_cache, v_cache, page_table, page, Tiles.of_decode(ctx), split=split
                )
                same &= torch.equal(got, packed[rows])
        entry = {
            "decode_equals_packed": same,
            "max_err_vs_flash": (packed.float() - ref.float()).abs().max().item(),
        }
        exact_s = _time(lambda: paged_attention(q, k, v, table, 1, tiles), 10)
        flash_s = _time(flash, 10)
        entry["prefill_ms"] = {
            "exact": exact_s * 1e3,
            "flash_varlen": flash_s * 1e3,
            "ratio": exact_s / flash_s,
        }
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        grad = torch.randn_like(q)
        exact_out, flash_out = (
            exact_packed_attention(*inputs, pages),
            packed_causal_attention(*inputs, layout),
        )
        exact_b = _time(lambda: torch.autograd.grad(exact_out, inputs, grad, retain_graph=True), 10)
        flash_b = _time(lambda: torch.autograd.grad(flash_out, inputs, grad, retain_graph=True), 10)
        entry["backward_ms"] = {
            "exact": exact_b * 1e3,
            "flash_varlen": flash_b * 1e3,
            "ratio": exact_b / flash_b,
        }
        for rows_n in (1, 64, 256):  # decode at ~1,000 tokens of context
            ctx = torch.full((rows_n,), 1000, device="cuda")
            tab = page_table[:1].expand(rows_n, -1).contiguous()
            qd = q[:rows_n].contiguous()
            split = rows_n * kv_heads <= 128
            e = _time(
                lambda: paged_attention(qd, k_cache, v_cache, tab, page, Tiles.of_decode(ctx), split=split)
            )
            o = _time(lambda: paged_decode_attention_triton(qd, k_cache, v_cache, tab, ctx.int(), page))
            entry[f"decode_b{rows_n}_us"] = {"exact": e * 1e6, "engine_kernel": o * 1e6, "ratio": e / o}
        out["attention"][f"{heads}x{kv_heads}x{dim}"] = entry
    return out


def as_in_training(eng: Engine, prompts: list[list[int]], response: int, steps: int = 4) -> dict:
    """Generation as a synchronous GRPO step runs it: the engine woken (its graphs dropped when it
    slept), 16 prompts x 8 samples with lengths spread by ~1/300 stop tokens per step (the batch
    shrinks through the graph buckets); each step's seconds and the engine's own counts."""
    stops = random.Random(1).sample(range(151936), 151936 // 300)
    runs = []
    for step in range(steps):
        eng.sleep()
        eng.wake()
        params = SamplingParams(n=8, temperature=1.0, max_tokens=response, stop_token_ids=stops, seed=step)
        torch.cuda.synchronize()
        start = time.perf_counter()
        gens = eng.generate(prompts, params)
        seconds = time.perf_counter() - start
        runs.append({"seconds": round(seconds, 4), "tokens": sum(len(g.token_ids) for g in gens),
                     **{k: round(v, 4) for k, v in eng.stats.items()}})  # fmt: skip
    return {
        "runs": runs,
        "seconds_after_the_first": round(sum(r["seconds"] for r in runs[1:]) / (steps - 1), 4),
    }


def engine(args) -> dict:
    rng = random.Random(0)
    model = random_model("0.5b", torch.device("cuda"), torch.float32)  # the trainer's fp32 master
    prompts = [
        [rng.randrange(151936) for _ in range(rng.randint(128, 512))] for _ in range(args.sequences // 8)
    ]
    out = {}
    for name, exact in (("ordinary", False), ("exact", True)):
        config = EngineConfig(max_batch_sequences=1024, max_context_tokens=512 + args.response + 1,
                              gpu_memory_utilization=0.6, exact_logprobs=exact, share_weights=False)  # fmt: skip
        eng = Engine(model, eos_token_ids=[], config=config, device=torch.device("cuda"))
        # warm-up: Triton's kernels compiled and the graphs captured for every bucket the timed runs use
        # (on a fresh machine the compiles otherwise land inside the first timing)
        # (other prompts of the same lengths: the timed runs' own would be prefix-cache hits)
        eng.generate(
            [[(t + 1) % 151936 for t in p] for p in prompts], SamplingParams(n=8, max_tokens=16, seed=1)
        )
        eng.generate(prompts[:1], SamplingParams(n=1, max_tokens=16, seed=1))  # batch 1's graphs
        result = {"steps_as_in_training": as_in_training(eng, prompts[:16], args.response)}
        if exact:  # and under the settings an exact run turns on in its processes (devices.seed_process)
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False
            result["steps_as_in_training_deterministic"] = as_in_training(eng, prompts[:16], args.response)
            torch.use_deterministic_algorithms(False)
        for label, batch, n in (("many", prompts, 8), ("batch1", prompts[:1], 1)):
            params = SamplingParams(n=n, temperature=1.0, max_tokens=args.response, seed=0)
            # each timed run starts as a training step does: the pool and graphs freed by a sleep (the
            # prefix cache with them) and woken; the graphs it replays captured first on other prompts
            # of the same lengths (the figure is the engine's rate, not its one-off costs). A median of
            # --repeats: one run moved by 0.85-1.0x between two leases on the H100, 2026-12-07
            runs = []
            for _ in range(args.repeats):
                eng.sleep()
                eng.wake()
                eng.generate([[(t + 1) % 151936 for t in p] for p in batch], replace(params, max_tokens=16))
                torch.cuda.synchronize()
                start = time.perf_counter()
                gens = eng.generate(batch, params)
                runs.append(time.perf_counter() - start)
            seconds = statistics.median(runs)
            tokens = sum(len(g.token_ids) for g in gens)
            result[label] = {
                "sequences": len(gens),
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "runs_seconds": [round(r, 4) for r in runs],
            }
            if label == "many":
                sample = gens[:64]
        eng.sleep()
        torch.cuda.empty_cache()
        # the trainer's log-probs of the sampled tokens (fp32 master, bf16 autocast)
        from hybridflow.roles.forward import packed_response_logprobs

        trainer = _fp32_master(model)
        if exact:
            trainer.use_exact_kernels()
        with torch.no_grad():
            lp, _ = packed_response_logprobs(
                trainer, [prompts[g.prompt_index] for g in sample], [g.token_ids for g in sample],
                device=torch.device("cuda"), compute_dtype="auto",
            )  # fmt: skip
        gaps = torch.cat(
            [
                (lp[i, : len(g.token_ids)].cpu() - torch.tensor(g.logprobs).float()).abs()
                for i, g in enumerate(sample)
            ]
        )
        prob_gaps = torch.cat(
            [
                (lp[i, : len(g.token_ids)].cpu().exp() - torch.tensor(g.logprobs).float().exp()).abs()
                for i, g in enumerate(sample)
            ]
        )
        result["logprob_gap_vs_trainer"] = {"tokens": gaps.numel(), "max": gaps.max().item(), "mean": gaps.mean().item(),
                                            "equal_tokens": int((gaps == 0).sum()), "prob_diff_max": prob_gaps.max().item()}  # fmt: skip
        del trainer, eng
        torch.cuda.empty_cache()
        out[name] = result
        print(name, json.dumps(result), flush=True)
    for key in ("steps_as_in_training", "steps_as_in_training_deterministic"):
        out[f"{key}_exact_over_ordinary"] = (
            out["ordinary"]["steps_as_in_training"]["seconds_after_the_first"]
            / out["exact"][key]["seconds_after_the_first"]
        )
    for label in ("many", "batch1"):
        out[f"{label}_exact_over_ordinary"] = (
            out["exact"][label]["tokens_per_s"] / out["ordinary"][label]["tokens_per_s"]
        )
    return out


def _training_step(exact: bool):
    """The 0.5B shape's packed forward + backward over ~16k tokens (chunked LM-head log-probs, bf16
    autocast over fp32 weights): (step, forward, tokens)."""
    from hybridflow.batch import pack_sequences
    from hybridflow.models.native import chunked_token_logprobs

    rng = random.Random(1)
    model = random_model("0.5b", torch.device("cuda"), torch.float32).train()
    if exact:
        model.use_exact_kernels()
    seqs, total = [], 0
    while total < 16384 - 1024:
        length = rng.randint(300, 1000)
        seqs.append([rng.randrange(151936) for _ in range(length)])
        total += length
    packed = pack_sequences(seqs)
    ids, pos = packed.input_ids.cuda(), packed.position_ids.cuda()
    cu = packed.cu_seqlens

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = model.hidden_states(ids, pos, cu)
            logp, _ = chunked_token_logprobs(
                hidden, model.lm_head.weight, torch.roll(ids, -1), chunk=4096, exact=exact
            )
        return logp

    def step():
        forward().sum().backward()

    return step, forward, int(ids.numel())


def training(args) -> dict:
    out = {}
    for name, exact in (("ordinary", False), ("exact", True)):
        step, forward, tokens = _training_step(exact)
        seconds = _time(step, 5)
        out[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        with torch.no_grad():
            out[name]["forward_tokens_per_s"] = tokens / _time(forward, 5)
        step = forward = None  # the model's memory back before the next
        torch.cuda.empty_cache()
    out["exact_over_ordinary"] = out["exact"]["tokens_per_s"] / out["ordinary"]["tokens_per_s"]
    out["forward_exact_over_ordinary"] = (
        out["exact"]["forward_tokens_per_s"] / out["ordinary"]["forward_tokens_per_s"]
    )
    return out


def profile(args) -> dict:
    """Where the exact step's time goes: the training step above under torch's profiler, ordinary and
    exact, each without and with trainer.deterministic's settings (devices.seed_process): GPU time,
    launches and the kernels that take longest."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    out = {}
    for name, exact in (("ordinary", False), ("exact", True)):
        step, _, tokens = _training_step(exact)
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic, warn_only=True)
            torch.utils.deterministic.fill_uninitialized_memory = False
            step()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            kernels: dict[str, list] = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    entry = kernels.setdefault(e.name[:100], [0.0, 0])
                    entry[0] += e.device_time_total / 1e3
                    entry[1] += 1
            top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
            out[f"{name}{'_deterministic' if deterministic else ''}"] = {
                "tokens": tokens,
                "wall_s": _time(step, 3),
                "gpu_ms": round(sum(v[0] for v in kernels.values()), 2),
                "launches": sum(v[1] for v in kernels.values()),
                "top_kernels_ms_count": {k: [round(v[0], 2), v[1]] for k, v in top},
            }
        torch.use_deterministic_algorithms(False)
        step = None
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="smoke,kernels,engine,training")
    parser.add_argument("--sequences", type=int, default=1024)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of the engine section's workloads (median)"
    )
    args = parser.parse_args()
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    for name in args.sections.split(","):
        began = time.time()
        try:
            result[name] = {
                "smoke": smoke,
                "kernels": kernels,
                "engine": engine,
                "training": training,
                "profile": profile,
            }[name](*([] if name in ("smoke", "kernels") else [args]))
        except Exception:
            result[name] = {"error": traceback.format_exc()[:12000]}  # the root cause comes first
            traceback.print_exc()
        result[name]["wall_s"] = time.time() - began
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
