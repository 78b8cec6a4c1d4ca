"""The rollout service on the H200: (1) a multi-turn workload with and without the prefix cache
(prefill tokens computed, wall time), (2) the OpenAI server's throughput at many concurrent clients
against the engine's in-process APIs, in the same run.

    PYTHONPATH=. python bench/serve_and_prefix.py --shape 1.5b --tokenizer DIR      # H200
    PYTHONPATH=. python bench/serve_and_prefix.py --shape smollm2 --tokenizer DIR --conversations 8 \\
        --clients 8 --rounds 2 --response 16 --reply 16                              # this CPU

Random-weight Qwen2.5-shaped models (bench/rollout.py), responses forced to full length (no EOS).
(1) 256 conversations x 4 turns: a shared system prompt, a first user message of its own, each turn
the model's reply plus a new user message appended; every turn is submitted at once (the request
API). (2) `clients` clients, each sending `rounds` requests of `prompt` random tokens for `response`
tokens one after the other: in-process (every request added at once: the ceiling), through
AsyncEngine (the same closed loop as the HTTP clients) and over HTTP (uvicorn in this process, httpx
clients in another).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.rollout.sampling import SamplingParams

sys.path.insert(0, "bench")
from rollout import SHAPES, random_model  # noqa: E402

LOAD = r"""
import asyncio, json, random, sys, time
import httpx

url, name = sys.argv[1], sys.argv[2]
first, clients, rounds, prompt_len, response, vocab = map(int, sys.argv[3:9])
start_at = float(sys.argv[9])
rng = random.Random(1)
prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range((first + clients) * rounds)]
errors = []

async def main():
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as c:
        async def one(i):
            body = {"model": name, "prompt": prompts[i], "max_tokens": response, "temperature": 1.0,
                    "seed": i, "return_token_ids": True}
            r = await c.post("/completions", json=body)
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:300]}")
                return 0
            return len(r.json()["choices"][0]["token_ids"])
        async def client(k):  # a closed loop: the next request when the last one is answered
            return sum([await one(k * rounds + j) for j in range(rounds)])
        await one(first * rounds)  # a connection, and the server's first request
        await asyncio.sleep(max(0.0, start_at - time.time()))  # every process starts together
        start = time.time()
        tokens = await asyncio.gather(*(client(k) for k in range(first, first + clients)))
        print(json.dumps({"start": start, "end": time.time(), "tokens": sum(tokens), "errors": errors[:3],
                          "n_errors": len(errors)}))

asyncio.run(main())
"""


def http_load(url: str, args, vocab: int) -> dict:
    """`args.clients` closed-loop clients spread over `args.client_processes` processes (one httpx
    process saturates a core near 100 connections: the load generator must not be what is measured)."""
    per = -(-args.clients // args.client_processes)
    start_at = time.time() + 5.0
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOAD,
                url,
                "bench",
                str(first),
                str(min(per, args.clients - first)),
                str(args.rounds),
                str(args.prompt),
                str(args.response),
                str(vocab),
                str(start_at),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for first in range(0, args.clients, per)
    ]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode:
            print(err[-3000:], file=sys.stderr, flush=True)
            raise SystemExit(f"a load generator failed: {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "seconds": max(r["end"] for r in reports) - min(r["start"] for r in reports),
        "tokens": sum(r["tokens"] for r in reports),
        "errors": sum(r["n_errors"] for r in reports),
        "first_errors": [e for r in reports for e in r["errors"]][:3],
    }


def engine_for(model, *, prefix_cache: bool, context: int, device) -> Engine:
    config = EngineConfig(max_context_tokens=context, prefix_cache=prefix_cache, gpu_memory_utilization=0.5,
                          page_size=64 if device.type == "cuda" else 16,
                          kv_cache_tokens=None if device.type == "cuda" else 64 * context)  # fmt: skip
    return Engine(model, eos_token_ids=[], config=config, device=device)


def run_all(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    out: dict[str, list[int]] = {r[0]: [] for r in requests}
    while engine.has_unfinished_requests:
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return out


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def multi_turn(model, args, device, vocab: int, prefix_cache: bool) -> dict:
    rng = random.Random(0)
    system = [rng.randrange(vocab) for _ in range(args.system)]
    convs = [system + [rng.randrange(vocab) for _ in range(args.first)] for _ in range(args.conversations)]
    context = args.system + args.first + args.turns * args.reply + (args.turns - 1) * args.user + 8
    engine = engine_for(model, prefix_cache=prefix_cache, context=context, device=device)
    run_all(engine, [("warm", convs[0][:64], SamplingParams(max_tokens=8, seed=0))])  # graphs, kernels
    s = engine.scheduler
    admitted, cached = s.admitted_tokens, s.cached_tokens
    sync(device)
    start, turns = time.perf_counter(), []
    for t in range(args.turns):
        t0 = time.perf_counter()
        reqs = [(f"c{i}-t{t}", conv, SamplingParams(max_tokens=args.reply, temperature=1.0, seed=i * 10 + t))
                for i, conv in enumerate(convs)]  # fmt: skip
        replies = run_all(engine, reqs)
        sync(device)
        turns.append(round(time.perf_counter() - t0, 3))
        convs = [conv + replies[f"c{i}-t{t}"] + [rng.randrange(vocab) for _ in range(args.user)]
                 for i, conv in enumerate(convs)]  # fmt: skip
    seconds = time.perf_counter() - start
    admitted, cached = s.admitted_tokens - admitted, s.cached_tokens - cached
    result = {"prefix_cache": prefix_cache, "seconds": round(seconds, 3), "turn_seconds": turns,
              "prompt_tokens": admitted, "prefill_computed_tokens": admitted - cached,
              "hit_rate": round(cached / admitted, 4)}  # fmt: skip
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def serving(model, tokenizer, args, device, vocab: int) -> dict:
    from hybridflow.serve.server import BackgroundServer

    rng = random.Random(1)  # the load script's prompts
    total = args.clients * args.rounds
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(total)]
    context = args.prompt + args.response + 8
    engine = engine_for(model, prefix_cache=True, context=context, device=device)
    params = [SamplingParams(max_tokens=args.response, temperature=1.0, seed=i) for i in range(total)]
    run_all(engine, [("warm", prompts[0], params[0])])
    results: dict = {}
    for attempt in range(2):
        engine.cache.pool.forget_prefixes()  # every attempt prefills everything
        sync(device)
        t0 = time.perf_counter()
        out = run_all(engine, [(f"r{attempt}-{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))])
        sync(device)
        results.setdefault("in_process_all_at_once", []).append(
            {"seconds": time.perf_counter() - t0, "tokens": sum(map(len, out.values()))}
        )

    async def closed_loop() -> dict:
        front = AsyncEngine(engine)

        async def client(k: int) -> int:
            got = 0
            for j in range(args.rounds):
                i = k * args.rounds + j
                got += len((await front.generate(prompts[i], params[i]))[0].token_ids)
            return got

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(client(k) for k in range(args.clients)))
        seconds = time.perf_counter() - t0
        await front.aclose()
        return {"seconds": seconds, "tokens": sum(tokens)}

    for _ in range(2):
        engine.cache.pool.forget_prefixes()
        results.setdefault("async_engine_closed_loop", []).append(asyncio.run(closed_loop()))
    server = BackgroundServer(engine, tokenizer, model_name="bench").start()
    try:
        for _ in range(2):
            server.call(lambda e: e.cache.pool.forget_prefixes())
            results.setdefault("http_closed_loop", []).append(http_load(server.url, args, vocab))
    finally:
        server.stop()
    for runs in results.values():
        for r in runs:
            r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1) if r["seconds"] else 0.0
            r["seconds"] = round(r["seconds"], 3)
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in results.items()}
    results["http_vs_async_engine_overhead"] = round(
        1 - best["http_closed_loop"] / best["async_engine_closed_loop"], 4
    )
    results["http_vs_all_at_once_overhead"] = round(
        1 - best["http_closed_loop"] / best["in_process_all_at_once"], 4
    )
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=[*SHAPES, "smollm2"], default="1.5b")
    ap.add_argument("--tokenizer", required=True, help="an HF tokenizer directory (the server detokenizes)")
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=256)
    ap.add_argument("--first", type=int, default=256)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--reply", type=int, default=128)
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4, help="requests per client, one after the other")
    ap.add_argument(
        "--client-processes", type=int, default=8, help="processes the HTTP clients are spread over"
    )
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--skip", choices=["multi-turn", "serving"], action="append", default=[])
    args = ap.parse_args()
    from transformers import AutoTokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.shape == "smollm2":
        from hybridflow.models import load_causal_lm

        model = load_causal_lm("default", impl="native")[0].to(device)
    else:
        model = random_model(args.shape, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = min(len(tokenizer), model.config.vocab_size)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": args.shape,
              "args": vars(args)}  # fmt: skip
    if "multi-turn" not in args.skip:
        report["multi_turn"] = [multi_turn(model, args, device, vocab, p) for p in (False, True)]
        print(json.dumps(report["multi_turn"]), flush=True)
    if "serving" not in args.skip:
        report["serving"] = serving(model, tokenizer, args, device, vocab)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
