"""What AsyncEngine's driver costs per step when hundreds of requests run, without a model: an engine
stand-in whose step() gives every running request one token (as the real one does, one
RequestOutput each), read by `stream(every_step=True)` (a wake-up per request per step) and by
`generate` (one per sample at its end, outputs merged), with the garbage collector on and off.

    PYTHONPATH=. python bench/async_engine_wakeups.py --requests 256 --tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import time

from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.engine.requests import RequestOutput
from hybridflow.rollout.sampling import SamplingParams


class TokenPerStep:
    """The request API's shape: add_request / abort / step, one token per running request per step."""

    paused = asleep = False

    def __init__(self, tokens: int) -> None:
        self.tokens, self.left, self.steps = tokens, {}, 0

    def add_request(self, request_id, prompt_ids, params) -> None:
        self.left[request_id] = self.tokens

    def abort(self, request_id) -> None:
        self.left.pop(request_id, None)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        out = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            done = self.left[request_id] == 0
            out.append(RequestOutput(request_id, 0, [1], [-0.5], [-0.5], "length" if done else None, 0))
            if done:
                del self.left[request_id]
        return out


async def per_step_ms(requests: int, tokens: int, every_step: bool) -> float:
    engine = TokenPerStep(tokens)
    front = AsyncEngine(engine)
    params = SamplingParams(max_tokens=tokens)

    async def read_every_step() -> None:
        async for _ in front.stream([1], params, every_step=True):
            pass

    start = time.perf_counter()
    if every_step:
        await asyncio.gather(*(read_every_step() for _ in range(requests)))
    else:
        await asyncio.gather(*(front.generate([1], params) for _ in range(requests)))
    seconds = time.perf_counter() - start
    await front.aclose()
    return 1e3 * seconds / engine.steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    report = {}
    for collector in ("on", "off"):
        (gc.enable if collector == "on" else gc.disable)()
        for every_step in (True, False):
            key = f"gc_{collector}_{'every_step' if every_step else 'results_only'}_ms_per_step"
            report[key] = round(
                min(asyncio.run(per_step_ms(args.requests, args.tokens, every_step)) for _ in range(3)), 3
            )
    gc.enable()
    print(json.dumps({"args": vars(args), **report}))


if __name__ == "__main__":
    main()
