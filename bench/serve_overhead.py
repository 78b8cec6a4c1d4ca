"""What the HTTP layer costs, without a GPU: a tiny engine whose every step also sleeps `--step-ms`
(the GPU's share of a step, with the GIL free as on a GPU), driven by closed-loop clients in-process
(AsyncEngine) and over HTTP (clients in `--client-processes` processes, bench/http_load.py). Also
counts the engine's prefill and decode steps (clients that arrive one by one fragment the batches)
and the CPU the server's event-loop thread spends per request (HTTP, validation, JSON, the driver:
all of it holds the GIL that the engine's thread needs too).

    PYTHONPATH=. python bench/serve_overhead.py --clients 128 --rounds 4 --step-ms 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import psutil

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.models import byte_tokenizer, tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.serve.server import BackgroundServer

sys.path.insert(0, "bench")
from http_load import http_load  # noqa: E402


class EmulatedGPU(Engine):
    """Each step that did work also waits `step_s` with the GIL released, and is counted."""

    step_s = 0.0
    counts = {"prefill": 0, "decode": 0}

    def _prefill(self, jobs):
        self.counts["prefill"] += 1
        return super()._prefill(jobs)

    def _decode(self):
        self.counts["decode"] += 1
        return super()._decode()

    def _step(self):
        out = super()._step()
        if out:
            time.sleep(self.step_s)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--client-processes", type=int, action="append", help="repeatable (default: 1 and 4)")
    args = ap.parse_args()
    model = from_hf_model(tiny_model("qwen2", seed=0, vocab_size=260, hidden_size=32, intermediate_size=64))
    context = args.prompt + args.response + 8
    config = EngineConfig(max_context_tokens=context, page_size=16, max_batch_sequences=args.clients,
                          kv_cache_tokens=(args.clients + 1) * context)  # fmt: skip
    engine = EmulatedGPU(model, eos_token_ids=[], config=config)
    engine.step_s = args.step_ms / 1000
    rng = random.Random(1)  # the load script's prompts
    prompts = [[rng.randrange(250) for _ in range(args.prompt)] for _ in range(args.clients * args.rounds)]

    async def closed_loop() -> float:
        front = AsyncEngine(engine)

        async def client(k: int) -> None:
            for j in range(args.rounds):
                i = k * args.rounds + j
                await front.generate(
                    prompts[i], SamplingParams(max_tokens=args.response, temperature=1.0, seed=i)
                )

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(args.clients)))
        seconds = time.perf_counter() - t0
        await front.aclose()
        return seconds

    report = {
        "args": vars(args),
        "async_engine": {"seconds": round(asyncio.run(closed_loop()), 2), **engine.counts},
    }
    server = BackgroundServer(engine, byte_tokenizer(), model_name="bench").start()

    def loop_thread_cpu() -> float:  # the server's event loop: HTTP, validation, JSON, the driver
        return next(
            t.user_time + t.system_time for t in psutil.Process().threads() if t.id == server.thread.native_id
        )

    try:
        for processes in args.client_processes or [1, 4]:
            engine.counts.update(prefill=0, decode=0)
            ns = argparse.Namespace(**{**vars(args), "client_processes": processes})
            cpu = loop_thread_cpu()
            got = http_load(server.url, ns, 250)
            per_request = (loop_thread_cpu() - cpu) / (
                args.clients * args.rounds + processes
            )  # + each warm-up
            report[f"http_{processes}_client_processes"] = {"seconds": round(got["seconds"], 2),
                                                             "errors": got["errors"], **engine.counts,
                                                             "loop_cpu_ms_per_request": round(per_request * 1e3, 3)}  # fmt: skip
    finally:
        server.stop()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
