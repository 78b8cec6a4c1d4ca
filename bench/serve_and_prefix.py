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
AsyncEngine (the same closed loop as the HTTP clients) and over HTTP (uvicorn in this process, the
clients in `--client-processes` others, with aiohttp and with httpx: bench/http_load.py). Each run
also counts the engine's prefill steps and decode runs: clients that reach the server spread out in
time split what would be one batch into several.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import torch

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.rollout.sampling import SamplingParams

sys.path.insert(0, "bench")
from http_load import http_load, response_length  # noqa: E402
from rollout import SHAPES, random_model  # noqa: E402


class CountingEngine(Engine):
    """Counts its prefill steps and decode runs, the sequences in them (how batches formed) and the
    seconds spent in each (the rest of a run's wall time the engine waited for requests)."""

    def reset_counts(self) -> None:
        self.counts = {"prefill_steps": 0, "decode_runs": 0, "decode_sequences": 0, "prefill_s": 0.0,
                       "decode_s": 0.0}  # fmt: skip
        self.timeline: list[tuple[float, float, str, int]] = []  # (start, end, kind, sequences)

    def _prefill(self, jobs):
        t0 = time.perf_counter()
        batch = super()._prefill(jobs)
        self.counts["prefill_steps"] += 1
        self.counts["prefill_s"] += time.perf_counter() - t0
        self.timeline.append((t0, time.perf_counter(), "prefill", len(batch)))
        return batch

    def _decode(self):
        t0 = time.perf_counter()
        batch = super()._decode()
        self.counts["decode_runs"] += 1
        self.counts["decode_sequences"] += len(batch)
        self.counts["decode_s"] += time.perf_counter() - t0
        self.timeline.append((t0, time.perf_counter(), "decode", len(batch)))
        return batch


def engine_for(model, *, prefix_cache: bool, context: int, device) -> Engine:
    config = EngineConfig(max_context_tokens=context, prefix_cache=prefix_cache, gpu_memory_utilization=0.5,
                          page_size=64 if device.type == "cuda" else 16,
                          kv_cache_tokens=None if device.type == "cuda" else 64 * context)  # fmt: skip
    engine = CountingEngine(model, eos_token_ids=[], config=config, device=device)
    engine.reset_counts()
    return engine


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
    context = args.prompt + args.response + args.response_spread + 8
    engine = engine_for(model, prefix_cache=True, context=context, device=device)
    lengths = [response_length(i, args.response, args.response_spread) for i in range(total)]
    params = [SamplingParams(max_tokens=n, temperature=1.0, seed=i) for i, n in enumerate(lengths)]
    run_all(engine, [("warm", prompts[0], params[0])])
    results: dict = {}
    timelines: dict[str, list] = {}  # phase -> the last attempt's engine steps

    def fresh() -> None:  # every attempt prefills everything, and counts its own steps
        engine.cache.pool.forget_prefixes()
        engine.reset_counts()

    for attempt in range(2):
        fresh()
        sync(device)
        t0 = time.perf_counter()
        out = run_all(engine, [(f"r{attempt}-{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))])
        sync(device)
        results.setdefault("in_process_all_at_once", []).append(
            {"seconds": time.perf_counter() - t0, "tokens": sum(map(len, out.values())), **engine.counts}
        )
        timelines["in_process_all_at_once"] = engine.timeline

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
        return {"seconds": seconds, "tokens": sum(tokens), **engine.counts}

    for _ in range(2):
        fresh()
        results.setdefault("async_engine_closed_loop", []).append(asyncio.run(closed_loop()))
        timelines["async_engine_closed_loop"] = engine.timeline
    for front in args.http_front:  # the HTTP front in N processes of its own, or in this one
        processes = int(front) if front.isdigit() else 1
        suffix = "_front_in_engine_process" if front == "thread" else f"_{processes}_front_processes"
        server = BackgroundServer(
            engine, tokenizer, model_name="bench", api_process=front != "thread", api_processes=processes
        ).start()
        try:
            for client in args.http_client:
                for _ in range(2):
                    server.call(lambda e: fresh())
                    got = http_load(server.url, args, vocab, client)
                    results.setdefault(f"http_closed_loop_{client}{suffix}", []).append(got | engine.counts)
                    timelines[f"http_closed_loop_{client}{suffix}"] = engine.timeline
            for ms in args.switch_interval_ms:  # how long the event loop's thread may wait for the GIL
                default = sys.getswitchinterval()
                sys.setswitchinterval(ms / 1000)
                try:
                    server.call(lambda e: fresh())
                    got = http_load(server.url, args, vocab, args.http_client[0])
                    results.setdefault(f"http_switch_interval_{ms}ms{suffix}", []).append(got | engine.counts)
                finally:
                    sys.setswitchinterval(default)
        finally:
            server.stop()
    if args.timeline:
        with open(args.timeline, "w") as f:
            json.dump(timelines, f)
    for runs in results.values():
        for r in runs:
            r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 1) if r["seconds"] else 0.0
            r["seconds"], r["prefill_s"], r["decode_s"] = (
                round(r[k], 3) for k in ("seconds", "prefill_s", "decode_s")
            )
    best = {k: max(r["tokens_per_s"] for r in v) for k, v in results.items()}
    for key in [k for k in best if k.startswith("http_closed_loop_")]:
        name = key.removeprefix("http_closed_loop_")
        results[f"http_{name}_vs_async_engine_overhead"] = round(
            1 - best[key] / best["async_engine_closed_loop"], 4
        )
        results[f"http_{name}_vs_all_at_once_overhead"] = round(
            1 - best[key] / best["in_process_all_at_once"], 4
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
    ap.add_argument("--http-client", choices=["aiohttp", "httpx"], action="append",
                    help="the load generator's HTTP client (repeatable; default: both)")  # fmt: skip
    ap.add_argument("--switch-interval-ms", type=float, action="append", default=[],
                    help="also run the first HTTP client with sys.setswitchinterval at this value (repeatable)")  # fmt: skip
    ap.add_argument("--response-spread", type=int, default=0,
                    help="request i asks for response +- this many tokens (0: all alike, lockstep)")  # fmt: skip
    ap.add_argument("--timeline", help="write each phase's engine steps (start, end, kind, sequences) here")
    ap.add_argument("--http-front", action="append",
                    help="N: the HTTP front in N processes of its own; thread: in the engine's (repeatable; default: 1)")  # fmt: skip
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--skip", choices=["multi-turn", "serving"], action="append", default=[])
    args = ap.parse_args()
    args.http_client = args.http_client or ["aiohttp", "httpx"]
    args.http_front = args.http_front or ["1"]
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
