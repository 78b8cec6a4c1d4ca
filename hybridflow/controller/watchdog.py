"""A phase of a step that runs past its limit is stuck: the watchdog writes every thread's stack to a
file and turns the hang into an error naming the phase, instead of a run that waits forever.

The error is raised in the main thread (a signal interrupts the waits Python can interrupt: a lock,
a future, a sleep, a pipe). A main thread that stays stuck past a grace period (a C call that never
returns, signals blocked) is ended with the same line and exit status 3.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_STUCK = 3


class PhaseStuck(BaseException):
    """Raised in the main thread. A BaseException: a reward's `except Exception` must not swallow it."""


class Watchdog:
    def __init__(
        self, limit_s: float, stacks_dir: Path, *, grace_s: float = 30.0, poll_s: float = 0.5
    ) -> None:
        self.limit_s, self.grace_s, self.poll_s = limit_s, grace_s, poll_s
        self.stacks_dir = stacks_dir
        self.step = 0
        self._phases: list[tuple[str, float]] = []  # the phases open now, outermost first
        self._lock = threading.Lock()
        self._fired: str | None = None
        # where the latest error left a phase, the phase's name and id(error) (not the error: its frames
        # would keep their tensors alive in a run that goes on)
        self.failed: tuple[str, str, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._previous_handler = None

    @property
    def enabled(self) -> bool:
        return self.limit_s > 0

    def __enter__(self) -> Watchdog:
        if self.enabled:
            if threading.current_thread() is threading.main_thread():
                self._previous_handler = signal.signal(signal.SIGUSR1, self._raise)
            self._thread = threading.Thread(target=self._watch, name="hybridflow-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._previous_handler is not None:
            signal.signal(signal.SIGUSR1, self._previous_handler)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """`name` runs inside the phases open now; from another thread too (a stream scoring groups
        while the trainer waits in `gen`: phase reward in step > gen)."""
        entry = (name, time.monotonic())
        with self._lock:
            self._phases.append(entry)
        try:
            yield
        except BaseException as e:
            with self._lock:
                if self.failed is None or self.failed[2] != id(e):  # the innermost phase sees it first
                    self.failed = (self._describe(), name, id(e))
            raise
        finally:
            with self._lock:
                self._phases.remove(entry)  # (the last but for another thread's phase)

    def _describe(self) -> str:
        names = [n for n, _ in self._phases]
        inner = names[-1] + (f" (in {' > '.join(names[:-1])})" if len(names) > 1 else "")
        return f"step {self.step}: phase {inner}"

    def _raise(self, signum, frame) -> None:
        raise PhaseStuck(self._fired or "stuck")

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                if not self._phases:
                    continue
                name, started = self._phases[-1]
                elapsed = time.monotonic() - started
                if elapsed < self.limit_s:
                    continue
                where = self._describe()
            stacks = self._dump_stacks()
            self._fired = (
                f"{where} has run {elapsed:.0f} s, past trainer.watchdog_s={self.limit_s:g}: it is stuck. "
                f"Every thread's stack: {stacks} (raise trainer.watchdog_s if it was only slow; 0 turns it off)"
            )
            print(self._fired, file=sys.stderr, flush=True)
            if self._previous_handler is not None:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            if self._stop.wait(self.grace_s):
                return
            print(
                f"{where} did not stop within {self.grace_s:g} s of being told: exiting",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_STUCK)

    def _dump_stacks(self) -> Path:
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        path = self.stacks_dir / f"stacks-step{self.step}.txt"
        with open(path, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path
