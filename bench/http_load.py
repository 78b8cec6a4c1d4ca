"""Closed-loop HTTP load on a `/v1/completions` server: `clients` clients, each sending `rounds`
requests of random token ids one after the other, spread over several processes (one Python
process saturates a core near a hundred connections: the load generator must not be what is
measured). `--client aiohttp` (what vLLM's serving benchmark uses) or `httpx` (what the openai
client is built on). Each process prints one JSON line; `http_load()` starts them and sums up.

Besides throughput it reports how the requests reached the server: for each round, the spread of
the clients' send times (a spread wider than an engine step splits one batch into several), and the
client's turnaround (from a reply to the next request).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time


def response_length(i: int, response: int, spread: int) -> int:
    """Request i's max_tokens: `response` +- `spread`, spread evenly (the in-process runs use it too)."""
    return response - spread + (i * 7919) % (2 * spread + 1) if spread else response


async def _one_process(a) -> dict:
    rng = random.Random(1)  # the same prompts as the in-process runs of serve_and_prefix
    total = (a.first + a.clients) * a.rounds
    prompts = [[rng.randrange(a.vocab) for _ in range(a.prompt)] for _ in range(total)]
    errors: list[str] = []
    times: dict[int, tuple[float, float]] = {}  # request -> (sent, answered)

    def body(i: int) -> dict:
        return {"model": a.model, "prompt": prompts[i], "max_tokens": response_length(i, a.response, a.spread), "temperature": 1.0,
                "seed": i, "return_token_ids": True}  # fmt: skip

    if a.client == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=a.clients + 1), timeout=aiohttp.ClientTimeout(total=600)
        )

        async def post(i: int) -> tuple[int, str]:
            async with session.post(f"{a.url}/completions", json=body(i)) as r:
                return r.status, await r.text()

    else:
        import httpx

        limits = httpx.Limits(max_connections=a.clients + 1, max_keepalive_connections=a.clients + 1)
        session = httpx.AsyncClient(base_url=a.url, limits=limits, timeout=600)

        async def post(i: int) -> tuple[int, str]:
            r = await session.post("/completions", json=body(i))
            return r.status_code, r.text

    async def one(i: int) -> int:
        sent = time.time()
        status, text = await post(i)
        if status != 200:
            errors.append(f"{status} {text[:300]}")
            return 0
        got = len(json.loads(text)["choices"][0]["token_ids"])
        times[i] = (sent, time.time())
        return got

    async def client(k: int) -> int:  # the next request when the last one is answered
        return sum([await one(k * a.rounds + j) for j in range(a.rounds)])

    try:
        await one(a.first * a.rounds)  # a connection, and the server's first request
        times.clear()
        await asyncio.sleep(max(0.0, a.start_at - time.time()))  # every process starts together
        start = time.time()
        tokens = await asyncio.gather(*(client(k) for k in range(a.first, a.first + a.clients)))
        end = time.time()
    finally:
        await session.close() if a.client == "aiohttp" else await session.aclose()
    return {"start": start, "end": end, "tokens": sum(tokens), "errors": errors[:3], "n_errors": len(errors),
            "times": {str(i): t for i, t in times.items()}}  # fmt: skip


def http_load(url: str, args, vocab: int, client: str = "aiohttp") -> dict:
    """`args.clients` closed-loop clients over `args.client_processes` processes of `client`."""
    per = -(-args.clients // args.client_processes)
    start_at = time.time() + 5.0
    procs = []
    for first in range(0, args.clients, per):
        argv = [sys.executable, __file__, url, "--model", "bench", "--first", str(first),
                "--clients", str(min(per, args.clients - first)), "--rounds", str(args.rounds),
                "--prompt", str(args.prompt), "--response", str(args.response), "--vocab", str(vocab),
                "--spread", str(getattr(args, "response_spread", 0)),
                "--start-at", str(start_at), "--client", client]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode:
            print(err[-3000:], file=sys.stderr, flush=True)
            raise SystemExit(f"a load generator failed: {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    times = {int(i): t for r in reports for i, t in r["times"].items()}
    spread, turnaround = [], []
    for j in range(args.rounds):
        sends = [times[i][0] for i in times if i % args.rounds == j]
        if sends:
            spread.append(round(max(sends) - min(sends), 4))
        if j:
            gaps = [times[i][0] - times[i - 1][1] for i in times if i % args.rounds == j and i - 1 in times]
            turnaround.append(round(statistics.median(gaps), 4) if gaps else None)
    return {
        "client": client,
        "seconds": max(r["end"] for r in reports) - min(r["start"] for r in reports),
        "tokens": sum(r["tokens"] for r in reports),
        "errors": sum(r["n_errors"] for r in reports),
        "first_errors": [e for r in reports for e in r["errors"]][:3],
        "send_spread_s_per_round": spread,
        "median_turnaround_s_per_round": turnaround,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--model", default="bench")
    ap.add_argument("--first", type=int, default=0, help="the first client's index (its prompts)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--spread", type=int, default=0, help="max_tokens varies by up to this much")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--start-at", type=float, default=0.0, help="a time.time() at which all processes start")
    ap.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp")
    print(json.dumps(asyncio.run(_one_process(ap.parse_args()))))


if __name__ == "__main__":
    main()
