"""What every stream of groups shares (GroupStream in this process, RemoteGroupStream over rollout
workers): each sample's record as the stream sees it (JSON for a checkpoint), finished groups, and
the buffer that holds admitted groups until the trainer takes them, with generation's idle time."""

from __future__ import annotations

import base64
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from hybridflow.batch import Rollouts
from hybridflow.errors import UserError


@dataclass
class SampleRecord:
    """One sample's response so far, as the stream has seen it (the engine's outputs, each token's
    policy version); finish None while it runs."""

    ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish: str | None = None
    routes: torch.Tensor | None = None
    """The engine's recorded experts once finished (router replay), [tokens - 1, MoE layers, k] int16;
    checkpointed with the rest, so a finished sample replays its own after a resume (an unfinished
    one is prefilled again and records them anew)."""

    def as_json(self) -> dict:
        """Copies: the stream goes on appending to the record while a checkpoint writes these."""
        return {
            "ids": list(self.ids),
            "logprobs": list(self.logprobs),
            "versions": list(self.versions),
            "finish": self.finish,
            **({"routes": routes_to_json(self.routes)} if self.routes is not None else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> SampleRecord:
        routes = routes_from_json(d["routes"]) if d.get("routes") is not None else None
        return cls(list(d["ids"]), list(d["logprobs"]), list(d["versions"]), d["finish"], routes)


def routes_to_json(routes: torch.Tensor) -> dict:
    """A routes tensor as JSON: its shape and its int16 bytes in base64 (a third of a list's size)."""
    data = routes.to(torch.int16).contiguous().numpy().tobytes()
    return {"shape": list(routes.shape), "int16": base64.b64encode(data).decode("ascii")}


def routes_from_json(d: dict) -> torch.Tensor:
    flat = np.frombuffer(base64.b64decode(d["int16"]), dtype=np.int16).copy()
    return torch.from_numpy(flat).view(d["shape"])


def finished_records(rollouts: Rollouts) -> list[dict]:
    """A finished group's samples as SampleRecord JSON (a checkpoint's groups in flight)."""
    return [
        SampleRecord(ids, lp, v, f, routes).as_json()
        for ids, lp, v, f, routes in zip(
            rollouts.response_ids,
            rollouts.response_logprobs,
            rollouts.policy_versions,
            rollouts.finish_reasons,
            rollouts.routed_experts or [None] * len(rollouts),
        )
    ]


def fresh_records(n: int) -> list[SampleRecord]:
    return [SampleRecord([], [], []) for _ in range(n)]


@dataclass
class FinishedGroup:
    rollouts: Rollouts  # the group's n rows
    outcomes: list  # the reward's Outcome per row
    finished_at: float  # time.perf_counter() when scoring ended


class GroupBuffer:
    """Admitted groups until they finish, then held until the trainer takes them: the part every
    stream shares (GroupStream here, RemoteGroupStream over rollout workers), with the time no
    admitted group was running (generation's idle time)."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._finished: dict[int, FinishedGroup] = {}
        self._running: set[int] = set()
        self._paused = False  # the engine paused for the trainer (a stream that pauses for training)
        self._idle_since: float | None = time.perf_counter()  # no group running, or paused, since then
        self._idle = 0.0  # seconds idle so, since take_idle_seconds last asked
        self._error: BaseException | None = None
        self._changed = threading.Condition()

    def _admitted(self, group_ids) -> None:
        with self._changed:
            self._running.update(group_ids)
            self._tick_idle_clock()

    def _done(self, group_id: int, rollouts: Rollouts, outcomes) -> None:
        with self._changed:
            self._finished[group_id] = FinishedGroup(rollouts, outcomes, time.perf_counter())
            self._running.discard(group_id)
            self._tick_idle_clock()
            self._changed.notify_all()

    def _tick_idle_clock(self) -> None:
        """Under the lock, after the running groups or the pause changed: the engine is idle while no
        admitted group runs, or while it is paused for the trainer."""
        idle, now = self._paused or not self._running, time.perf_counter()
        if idle and self._idle_since is None:
            self._idle_since = now
        elif not idle and self._idle_since is not None:
            self._idle += now - self._idle_since
            self._idle_since = None

    def _failed(self, error: BaseException) -> None:
        """Generation or scoring failed: the trainer hears it at its next take() or update (the first
        failure: later ones are its consequences, as a group submitted to an engine already stopped)."""
        with self._changed:
            self._error = self._error or error
            self._changed.notify_all()

    def wait_finished(self, timeout: float) -> None:
        """Until a group has finished and waits to be handed over (or the stream failed), at most `timeout`."""
        with self._changed:
            self._changed.wait_for(lambda: self._finished or self._error is not None, timeout)

    def run_until(self, group_ids: list[int]) -> None:
        """Generation may go on until these groups have finished (a stream that pauses for training)."""

    def take(self, group_ids: list[int], progress=None) -> tuple[list[FinishedGroup], float]:
        """These groups once all have finished and been scored (in the order given), and the seconds
        the trainer waited for them; `progress(done)` hears how many have, as they do."""
        start = time.perf_counter()
        with self._changed:
            while True:
                self._raise_error()
                done = sum(g in self._finished for g in group_ids)
                if progress is not None:
                    progress(done)
                if done == len(group_ids):
                    return [self._finished.pop(g) for g in group_ids], time.perf_counter() - start
                left = start + self.deadline_s - time.perf_counter()
                if left <= 0:
                    missing = [g for g in group_ids if g not in self._finished]
                    raise UserError(
                        f"groups {missing[:5]} did not finish within {self.deadline_s:.0f} s (trainer.watchdog_s)"
                    )
                self._changed.wait(left)

    def take_idle_seconds(self) -> float:
        """Seconds with no admitted group to work on (waiting for the trainer's next update to admit
        more), or paused for the trainer, since the last call."""
        with self._changed:
            now = time.perf_counter()
            idle = self._idle + (now - self._idle_since if self._idle_since is not None else 0.0)
            self._idle, self._idle_since = 0.0, now if self._idle_since is not None else None
            return idle

    def take_recovery_metrics(self) -> dict[str, float]:
        """What was done about dead rollout workers since the last call (nothing, in one process)."""
        return {}

    @property
    def running(self) -> int:
        with self._changed:
            return len(self._running)

    def _raise_error(self) -> None:
        if self._error is not None:  # as raised in the stream (NonFiniteLogits keeps its diagnosis)
            raise self._error
