"""The engine's decode side: runs of decode steps of the running sequences, a run launched ahead of
the host's reading of the last one, and speculative steps. The engine (engine.py) owns the requests,
the prefill and the weights; it asks for one run at a time (`DecodeRuns.run`) and drops a run launched
ahead (`drop_ahead`) before the weights, the pool or the schedule change."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from hybridflow.engine.runner import Runner
from hybridflow.engine.sampled import SampledRun
from hybridflow.engine.scheduler import Scheduler
from hybridflow.engine.sequence import Sequence, limits_after
from hybridflow.engine.speculation import Speculation


@dataclass
class DecodeRun:
    """A launched run of decode steps: its sequences, the steps each may take, its draws (read with
    `sampled.fetch()`), and whether its steps ran whole on the device (a next run may follow it)."""

    batch: list[Sequence]
    limits: list[int]
    sampled: SampledRun
    on_device: bool


class DecodeRuns:
    """Each `run` is up to `steps` decode steps of every running sequence with no host sync between
    them, recorded at its end through `record(batch, drawn, limits)` (which appends the tokens and
    retires the finished). A run whose steps ran whole on the device is followed at once by the next
    run of its sequences, launched before its draws are read: the host's reading, recording and
    scheduling overlap the device's next run instead of leaving it idle. With `speculation`, while few
    sequences run (and, adaptive, where it measures faster), a run is one speculative step instead
    (the drafter needs the last run's tokens: no run is launched ahead of one that may speculate).
    `counts`: runs, runs launched ahead, steps and their milliseconds (each run ends in its one sync,
    so the device's time too)."""

    def __init__(
        self,
        runner: Runner,
        *,
        steps: int,
        exact: bool,
        max_rows: int,
        device: torch.device,
        stops_for: Callable,
        record: Callable[[list[Sequence], np.ndarray, list[int]], None],
        speculation: Speculation | None = None,
        tensor_parallel=None,
    ) -> None:
        self.runner, self.steps, self.exact = runner, steps, exact
        self.max_rows, self.device = max_rows, device
        self.stops_for, self.record = stops_for, record
        self.speculation, self.tp = speculation, tensor_parallel
        self.ahead: DecodeRun | None = None  # a run launched before the last one was read
        self.counts = dict.fromkeys(("decode_runs", "decode_runs_ahead", "decode_steps", "decode_ms"), 0)

    def run(self, scheduler: Scheduler) -> list[Sequence]:
        """One run of `scheduler`'s running sequences; returns the sequences recorded. Speculating:
        one speculative step, or with no draft now a run that ends when the first sequence may draft
        again (a draft may match after the next token)."""
        k, running, spec = self.steps, list(scheduler.running.values()), self.speculation
        # too many run to speculate: plain runs, each next one launched ahead while none could
        # speculate (a run ahead is read first; the next after it speculates where it may)
        plain_only = spec is None or not spec.applies(len(running))
        if plain_only or self.ahead is not None:
            return self._plain_run(scheduler, k, launch_next=plain_only)
        speculate = spec.choose(len(running))
        started, captured = time.perf_counter(), self.runner.capture_seconds
        before = sum(len(s.tokens) for s in running)
        batch = self._speculate(scheduler) if speculate else None
        if batch is None:
            batch = self._plain_run(
                scheduler, spec.plain_steps(running, k) if speculate else k, launch_next=False
            )
        # the run ended in a fetch: its seconds are the device's too
        seconds = time.perf_counter() - started - (self.runner.capture_seconds - captured)
        spec.observe(speculate, seconds, sum(len(s.tokens) for s in running) - before, len(running))
        return batch

    def drop_ahead(self) -> None:
        """Wait for a run launched ahead and forget it (its draws never reach the sequences, which draw
        the same tokens again when next scheduled): before the weights, the pool or the schedule change."""
        if self.ahead is not None:
            self.ahead.sampled.fetch()
            self.ahead = None

    def _plain_run(self, scheduler: Scheduler, k: int, launch_next: bool) -> list[Sequence]:
        """Up to k decode steps of every running sequence (or the run launched ahead), recorded at its
        end; with `launch_next`, the next launched ahead where it can follow (`_launch_after`)."""
        started = time.perf_counter()
        run, self.ahead = self.ahead or self._launch(scheduler, k), None
        if launch_next and run.on_device and self.tp is None and not scheduler.waiting:
            self.ahead = self._launch_after(scheduler, run, k)
        # a sequence that ended before this run was read (a stop in the run before, an abort) is not its
        live = [i for i, s in enumerate(run.batch) if not s.finished]
        batch, drawn = [run.batch[i] for i in live], run.sampled.fetch()[:, :, live]
        self.record(batch, drawn, [run.limits[i] for i in live])
        self.counts["decode_runs"] += 1
        self.counts["decode_steps"] += max(run.limits)
        self.counts["decode_ms"] += round(1e3 * (time.perf_counter() - started))
        return batch

    def _sampled(self, batch: list[Sequence], steps: int, ahead=None) -> SampledRun:
        return SampledRun(
            batch, self.stops_for, steps=steps, device=self.device, exact=self.exact, ahead=ahead
        )

    def _launch(self, scheduler: Scheduler, k: int) -> DecodeRun:
        """Slots for up to k tokens of every running sequence (preempting when pages run short), and
        their run launched."""
        page_size = self.runner.page_size

        def wanted(s: Sequence) -> int:  # never past prompt + max_tokens or the context
            return min(k, s.end - len(s.tokens))

        batch = scheduler.schedule_decode(wanted)
        if not batch:
            raise RuntimeError("the engine cannot schedule any sequence (KV cache too small)")
        if self.tp is not None:
            self.tp.check_same_step("decode", batch)
        limits = [min(wanted(s), len(s.pages) * page_size - s.cached) for s in batch]
        sampled = self._sampled(batch, max(limits))
        on_device = self.runner.decode(batch, scheduler.table[[s.row for s in batch]], limits, sampled)
        sampled.to_host()
        return DecodeRun(batch, limits, sampled, on_device)

    def _launch_after(self, scheduler: Scheduler, run: DecodeRun, k: int) -> DecodeRun | None:
        """The next run of `run`'s sequences, launched from the device state `run` leaves (its last
        draws are the inputs): the tokens and noise of each step are those the run would have after
        `run` was read, so nothing drawn changes. None where it cannot follow (sequence.limits_after),
        or the pool has no free page for it (no preemption ahead of the schedule)."""
        limits = limits_after(run.batch, run.limits, k)
        if limits is None:
            return None
        for s, taken, more in zip(run.batch, run.limits, limits):  # K/V of all but the last token
            if more and not scheduler.reserve(s, s.cached + taken + more):
                return None
        sampled = self._sampled(run.batch, max(limits), ahead=run.limits)
        table = scheduler.table[[s.row for s in run.batch]]
        self.runner.decode(run.batch, table, limits, sampled, continued=True)
        sampled.to_host()
        self.counts["decode_runs_ahead"] += 1
        return DecodeRun(run.batch, limits, sampled, True)

    def _speculate(self, scheduler: Scheduler) -> list[Sequence] | None:
        """One decode step whose rows feed each running sequence its last token and its draft (the
        decode step's kernels and graphs: a row per fed token), drawing at every fed position with
        the noise the plain engine would use there (SampledRun's `ahead`): a sequence keeps its
        drafted tokens up to the first that differs from the draw, and the draw after them. So its
        tokens and log-probs are those of plain decoding: the draft only decides how many positions
        one forward checks. None: nothing drafted (a plain decode run instead)."""
        if self.ahead is not None:  # (its draws would be lost, its cache slots written over)
            raise RuntimeError("a speculative decode step while a run launched ahead is unread")
        spec = self.speculation
        drafts = spec.drafts(list(scheduler.running.values()))
        if not any(drafts.values()):
            return None
        batch = scheduler.schedule_decode(lambda s: len(drafts.get(s.seq_id, ())) + 1)
        if not batch:
            raise RuntimeError("the engine cannot schedule any sequence (KV cache too small)")
        rows = spec.plan(batch, drafts, self.runner.page_size, self.max_rows)
        if rows is None:  # no row to spare: a plain run (the pages taken are the next tokens')
            return None
        owners = [batch[i] for i in rows.owner]
        sampled = self._sampled(owners, 1, ahead=rows.ahead)
        table = scheduler.table[[s.row for s in owners]]
        self.runner.decode(owners, table, [1] * len(owners), sampled, feed=(rows.tokens, rows.positions))
        spec.settle(batch, rows, sampled.fetch()[0], self.record)
        return batch
