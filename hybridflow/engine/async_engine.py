"""An asyncio front over the request API: thousands of coroutines share one engine.

`await AsyncEngine(engine).generate(prompt_ids, params)` returns the request's generations;
`async for out in async_engine.stream(...)` yields each step's new tokens. Cancelling either aborts
the request (its pages are freed). One task drives the engine: requests added or aborted meanwhile
are applied between two steps, and each step runs in a thread of the engine's own (not asyncio's
shared pool, which callers may fill with work that waits: the steps must never queue behind it), so
the event loop keeps serving while the device works. With `own_device_stream` on CUDA the engine's kernels go to a stream of
its own, so that they run beside another thread's (the trainer's in an asynchronous run) instead of
queueing behind them on the default stream. A reader that needs only the result (`generate`, or
`stream(every_step=False)`) is woken once, when a sample finishes, not at every step: at hundreds of
requests, a wake-up per request per step would take the GIL from the engine's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import random
from collections.abc import AsyncIterator
from dataclasses import replace

import torch

from hybridflow.engine.engine import Engine
from hybridflow.engine.requests import RequestOutput, SampleSoFar
from hybridflow.rollout.sampling import Generation, NonFiniteLogits, SamplingParams


class _Failed:
    """Put on a request's queue: its prompt was refused (`fatal` False), or the engine stopped."""

    def __init__(self, error: BaseException, fatal: bool) -> None:
        self.error, self.fatal = error, fatal


class _Listener:
    """A request's reader: outputs are handed over in lists, at every step, or held until a sample
    finishes. Held outputs of a sample are merged while the weight version stays (one object per
    sample, not one per step: the garbage collector walks every live object)."""

    __slots__ = ("queue", "every_step", "hand_over", "held", "last", "on_first_output", "on_output")

    def __init__(self, every_step: bool, on_first_output, on_output, hand_over: bool = True) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.every_step, self.on_first_output, self.on_output = every_step, on_first_output, on_output
        self.hand_over = hand_over
        self.held: list[RequestOutput] = []
        self.last: dict[int, RequestOutput] = {}  # sample -> its latest held output

    def put(self, out: RequestOutput) -> None:
        if self.on_first_output is not None:
            self.on_first_output()
            self.on_first_output = None
        if self.on_output is not None:
            self.on_output(out)
        if not self.hand_over:  # on_output keeps what the reader needs: only a sample's end is said
            if out.finish_reason is not None:
                self.queue.put_nowait([out])
            return
        if self.every_step:
            self.queue.put_nowait([out])
            return
        last = self.last.get(out.sample)
        if last is not None and last.weight_version == out.weight_version:
            last.token_ids += out.token_ids
            last.logprobs += out.logprobs
            last.unscaled_logprobs += out.unscaled_logprobs
            last.finish_reason = out.finish_reason
        else:
            self.held.append(out)
            self.last[out.sample] = out
        if out.finish_reason is not None:
            self.queue.put_nowait([o for o in self.held if o.sample == out.sample])
            self.held = [o for o in self.held if o.sample != out.sample]
            del self.last[out.sample]


class AsyncEngine:
    def __init__(self, engine: Engine, *, own_device_stream: bool = False) -> None:
        self.engine = engine
        # only with a weight copy of its own: a module shared with the trainer is written on its stream
        separate = own_device_stream and engine.device.type == "cuda" and not engine.shares_trainer_module
        self._device_stream = torch.cuda.Stream(engine.device) if separate else None
        self._adds: list[tuple[str, list[int], SamplingParams, list[SampleSoFar | None] | None]] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[object, asyncio.Future, bool]] = []
        self._streams: dict[str, _Listener] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stepper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridflow-engine")
        self.error: BaseException | None = None

    @property
    def max_context_tokens(self) -> int:
        return self.engine.config.max_context_tokens

    async def engine_stats(self) -> dict[str, int]:
        return self.engine.serving_stats()

    def _ensure_running(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}") from self.error
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._drive(), name="hybridflow-engine")
        self._wake.set()

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        every_step: bool = True,
        on_first_output=None,
        on_output=None,
        resume: list[SampleSoFar | None] | None = None,
        hand_over: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Each step's new tokens of every sample, until all `params.n` have finished. With
        `every_step=False` a sample's outputs arrive together when it finishes (the same outputs,
        one wake-up). `on_first_output()` is called by the driver when the first tokens exist, and
        `on_output(out)` with every step's output (on the loop, between two steps: state it keeps is
        whole whenever `between_steps(..., on_loop=True)` reads it). `resume`: Engine.add_request's.
        `hand_over=False` (with `on_output` keeping what is needed): only each sample's last output is
        yielded, and nothing is held meanwhile (at hundreds of samples, the per-step bookkeeping of
        outputs no reader looks at held the engine's next step back)."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request {request_id!r} is already running")
        listener = _Listener(every_step, on_first_output, on_output, hand_over)
        self._streams[request_id] = listener
        self._adds.append((request_id, list(prompt_ids), params, resume))
        self._ensure_running()
        left = params.n - sum(r is not None and r.finish_reason is not None for r in resume or [])
        try:
            while left:
                outs = await listener.queue.get()
                if isinstance(outs, _Failed):
                    if outs.fatal and isinstance(outs.error, NonFiniteLogits):
                        # the policy's numbers, which the caller diagnoses: said as they are, a fresh one
                        # for each reader (one error raised in every request's coroutine would carry
                        # all their tracebacks)
                        raise NonFiniteLogits(*outs.error.args) from None
                    if outs.fatal:
                        raise RuntimeError(f"the engine stopped: {outs.error!r}") from outs.error
                    raise outs.error
                for out in outs:
                    left -= out.finished
                    yield out
        finally:
            self._streams.pop(request_id, None)
            if left and self.error is None:  # cancelled, or the reader stopped: nothing more is computed
                self._adds = [a for a in self._adds if a[0] != request_id]
                self._aborts.append(request_id)
                self._ensure_running()

    async def between_steps(self, fn, *, on_loop: bool = False):
        """Run `fn(engine)` in the driver between two steps (e.g. pause, update_weights, resume):
        nothing else touches the engine meanwhile. Returns its result. `on_loop`: on the event loop's
        thread (a quick read of what `on_output` callbacks keep), else in the engine's thread."""
        future = asyncio.get_running_loop().create_future()
        self._calls.append((fn, future, on_loop))
        self._ensure_running()
        return await future

    def wake_driver(self) -> None:
        """After resume() or wake() from outside: the driver looks again."""
        if self._wake is not None:
            self._wake.set()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> list[Generation]:
        samples = [Generation(0, [], [], "", []) for _ in range(params.n)]
        async for out in self.stream(prompt_ids, params, request_id, every_step=False):
            g = samples[out.sample]
            g.token_ids += out.token_ids
            g.logprobs += out.logprobs
            g.unscaled_logprobs += out.unscaled_logprobs
            g.finish_reason = out.finish_reason or g.finish_reason
        return samples

    async def generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        """Engine.generate's result (prompt-major, the same seeds: prompt i's sample j draws from
        (seed, first_sequence + i * n + j)) as concurrent requests beside any others."""
        base = params.seed if params.seed is not None else random.randrange(2**31 - 1)
        runs = [
            self.generate(p, replace(params, seed=base, first_sequence=params.first_sequence + i * params.n))
            for i, p in enumerate(prompts)
        ]
        out = []
        for i, samples in enumerate(await asyncio.gather(*runs)):
            for g in samples:
                g.prompt_index = i
                out.append(g)
        return out

    async def aclose(self) -> None:
        """Stop the driver (the loop is about to end)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._stepper.shutdown(wait=False)

    def _in_engine_thread(self, fn, *args):
        return asyncio.get_running_loop().run_in_executor(self._stepper, fn, *args)

    def _on_device_stream(self, fn, reads_others: bool = False):
        """fn() with the engine's kernels on its stream, complete when it returns (what it wrote is
        read on other streams: host lists, the weight-sync check). With `reads_others` (a call
        between steps, e.g. a weight update) the work queued on the default stream so far (the
        trainer's optimizer step) completes before it starts."""
        stream = self._device_stream
        if stream is None:
            return fn()
        if reads_others:
            stream.wait_stream(torch.cuda.default_stream(stream.device))
        with torch.cuda.stream(stream):
            result = fn()
        stream.synchronize()
        return result

    async def _drive(self) -> None:
        engine = self.engine
        try:
            while True:
                for request_id in self._aborts:
                    engine.abort(request_id)
                self._aborts.clear()
                for args in self._adds:
                    try:
                        engine.add_request(*args)
                    except Exception as e:  # a bad prompt fails its own request, not the others
                        if (listener := self._streams.get(args[0])) is not None:
                            listener.queue.put_nowait(_Failed(e, fatal=False))
                self._adds.clear()
                calls, self._calls = self._calls, []
                for fn, future, on_loop in calls:
                    try:
                        if on_loop:
                            result = fn(engine)
                        else:
                            result = await self._in_engine_thread(
                                self._on_device_stream, functools.partial(fn, engine), True
                            )
                    except Exception as e:
                        future.set_exception(e)
                    else:
                        future.set_result(result)
                if self._calls or self._adds or self._aborts:
                    continue
                if not engine.has_unfinished_requests or engine.paused or engine.asleep:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                streams = self._streams
                for out in await self._in_engine_thread(self._on_device_stream, engine.step):
                    if (listener := streams.get(out.request_id)) is not None:
                        listener.put(out)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the device failed: every waiting request hears of it
            self.error = e
            for listener in self._streams.values():
                listener.queue.put_nowait(_Failed(e, fatal=True))
            raise
