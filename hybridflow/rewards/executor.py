"""Score many responses in a process pool with a per-sample timeout. A reward that raises, hangs, or
returns a non-number scores 0 and is counted; it never crashes or stalls the run.

A reward function is either per-sample, verl's `compute_score(data_source, solution_str, ground_truth,
extra_info=None) -> float | dict`, or batched, `compute_score(data_sources, solution_strs,
ground_truths, extra_infos) -> list` (recognised by its first parameter's name); `async def` works
for both.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError
from dataclasses import dataclass, field
from typing import Any

from hybridflow.errors import UserError
from hybridflow.rewards.deadline import scoring_deadline
from hybridflow.rewards.worker_pool import ScoringPool, WorkerPoolFailed

Item = tuple[str, str, Any, dict]  # (data_source, solution_str, ground_truth, extra_info)


@dataclass
class Outcome:
    score: float = 0.0
    pred: str | None = None
    extras: dict[str, float] = field(default_factory=dict)
    error: bool = False
    timeout: bool = False
    latency_ms: float = 0.0
    message: str | None = None
    """What went wrong (the traceback of an exception, or what was returned instead of a number)."""


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout


def _normalize(out: Any, max_abs: float) -> Outcome:
    extras, pred = {}, None
    if isinstance(out, dict):
        extras = {
            k: float(v) for k, v in out.items() if k not in ("score", "pred") and isinstance(v, (int, float))
        }
        pred, out = out.get("pred"), out.get("score")
    try:
        value = float(out)
    except (TypeError, ValueError):
        return Outcome(error=True, pred=pred, message=f"the reward function returned {out!r}, not a number")
    if not math.isfinite(value) or abs(value) > max_abs:  # 1e39 is finite here, inf in float32
        return Outcome(
            error=True,
            pred=pred,
            message=f"the reward function returned {value} (|score| > reward.max_abs={max_abs:g}?)",
        )
    return Outcome(value, None if pred is None else str(pred), extras)


def is_batched(fn: Callable) -> bool:
    params = list(inspect.signature(fn).parameters)
    return bool(params) and params[0] in ("data_sources", "data_source_list")


def _call(fn: Callable, *args, **kwargs):
    out = fn(*args, **kwargs)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _run_items(
    fn: Callable, items: list[Item], timeout_s: float, options: dict, max_abs: float = 1e6
) -> list[Outcome]:
    """Score items here, each under a SIGALRM deadline (main thread of a pool worker)."""
    # alarms reach the main thread only: elsewhere (a trainer driven from a thread) no deadline
    use_alarm = (
        timeout_s > 0
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if use_alarm:
        signal.signal(signal.SIGALRM, _alarm)
    if is_batched(fn):
        start = time.perf_counter()
        try:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, timeout_s * max(1, len(items)))
            with scoring_deadline(timeout_s * max(1, len(items))):
                outs = _call(fn, *(list(col) for col in zip(*items)), **options)
            results = [_normalize(o, max_abs) for o in outs]
            if len(results) != len(items):
                message = (
                    f"the batched reward function returned {len(results)} scores for {len(items)} responses"
                )
                results = [Outcome(error=True, message=message) for _ in items]
        except _Timeout:
            results = [Outcome(timeout=True) for _ in items]
        except (Exception, SystemExit):  # sys.exit in a reward is its error, never the run's end
            message = traceback.format_exc()
            results = [Outcome(error=True, message=message) for _ in items]
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        per_item = (time.perf_counter() - start) * 1000 / max(len(items), 1)
        for r in results:
            r.latency_ms = per_item
        return results
    results = []
    for item in items:
        start = time.perf_counter()
        try:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
            with scoring_deadline(timeout_s):
                result = _normalize(_call(fn, *item, **options), max_abs)
        except _Timeout:
            result = Outcome(timeout=True)
        except (Exception, SystemExit):
            result = Outcome(error=True, message=traceback.format_exc())
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
        result.latency_ms = (time.perf_counter() - start) * 1000
        results.append(result)
    return results


class RewardExecutor:
    """`submit(items)` returns a Future of Outcomes (scoring runs while the caller goes on);
    `score(items)` waits for it. `num_workers=0` scores in this process."""

    def __init__(
        self,
        loader: Callable[[], Callable],
        *,
        num_workers: int,
        timeout_s: float,
        options: dict | None = None,
        start_timeout_s: float = 60.0,
        max_abs: float = 1e6,
    ) -> None:
        self.loader = loader
        self.start_timeout_s = start_timeout_s
        self.max_abs = max_abs
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.options = options or {}
        self.fn = loader()
        self.pool = (
            ScoringPool(num_workers, loader, _run_items, start_timeout_s=start_timeout_s)
            if num_workers > 0
            else None
        )
        self._workers_started = False
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-collector")

    def submit(self, items: list[Item]) -> Future:
        future: Future = Future()
        if self.pool is None or not items:
            future.set_result(_run_items(self.fn, items, self.timeout_s, self.options, self.max_abs))
            return future
        if not self._workers_started:
            self._check_workers_start()
        if is_batched(self.fn):
            chunks = [items]
        else:
            size = max(1, math.ceil(len(items) / (self.num_workers * 4)))
            chunks = [items[i : i + size] for i in range(0, len(items), size)]
        return self._collector.submit(self._collect, chunks)

    def deadline_s(self, chunk: list[Item]) -> float:
        """A hard deadline for one chunk, backing up the in-worker alarm (code stuck in C ignores
        signals): past it the worker is killed and what it held counts as timed out."""
        return self.timeout_s * len(chunk) + 5.0

    def _check_workers_start(self) -> None:
        """Workers that cannot load the function would fail every batch: stop with the likely cause."""
        try:
            self.pool.wait_ready()
        except WorkerPoolFailed as e:
            self.close()
            raise UserError(
                f"the reward workers did not start ({str(e).strip().splitlines()[-1]}); the reward "
                "function's module must import in a fresh process, or score in this process with "
                "reward.num_workers=0"
            ) from None
        self._workers_started = True

    def _collect(self, chunks: list[list[Item]]) -> list[Outcome]:
        results = self.pool.run_chunks(chunks, (self.timeout_s, self.options, self.max_abs), self.deadline_s)
        outcomes: list[Outcome] = []
        for chunk, (kind, detail) in zip(chunks, results):
            if kind == "done":
                outcomes += detail
            elif kind == "timeout":
                outcomes += [Outcome(timeout=True, latency_ms=self.timeout_s * 1000) for _ in chunk]
            else:
                outcomes += [Outcome(error=True, message=detail) for _ in chunk]
        return outcomes

    def wait_limit_s(self, n_items: int) -> float:
        """The longest scoring `n_items` can take: every chunk past its deadline, one after another,
        each on a replacement worker that had to start. A wait beyond it is a bug, not a slow reward."""
        chunks = n_items if self.pool is None else max(1, min(n_items, self.num_workers * 4))
        return self.timeout_s * n_items + (5.0 + self.start_timeout_s) * chunks + 60.0

    def result(self, future: Future, n_items: int) -> list[Outcome]:
        try:
            return future.result(timeout=self.wait_limit_s(n_items))
        except TimeoutError:
            raise RuntimeError(
                f"scoring {n_items} responses did not end within {self.wait_limit_s(n_items):.0f} s although "
                "every reward call has a deadline: the scoring pool is stuck (a bug; please report it)"
            ) from None

    def score(self, items: list[Item]) -> list[Outcome]:
        return self.result(self.submit(items), len(items))

    def run_at_niceness(self, niceness: int) -> None:
        """The scoring workers at `niceness` at least (scoring in this process: left as it is)."""
        if self.pool is not None:
            self.pool.run_at_niceness(niceness)

    def close(self) -> None:
        self._collector.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()
            self.pool = None
