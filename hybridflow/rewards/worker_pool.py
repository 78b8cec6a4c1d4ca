"""Scoring processes that cannot deadlock: each worker has its own pipe, so nothing is shared
between them (no task queue, no lock a dying process could hold). A worker past its chunk's deadline
is killed by PID and replaced; one that died (idle or busy) is replaced; every wait has a deadline.

multiprocessing.Pool shares one task queue and its lock between all workers: killing a stuck one
with `terminate()` could wait forever in `_help_stuff_finish` while idle workers held that lock, and
a killed idle worker could hang it the same way (seen on a loaded machine).
"""

from __future__ import annotations

import atexit
import os
import signal
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from hybridflow.child_process import ChildProcess, child_link, start_child

_WORKER_FN: Callable | None = None


def raise_niceness(pid: int, niceness: int) -> None:
    """Every thread of process `pid` at `niceness` at least (Linux keeps it per thread; an
    unprivileged process may raise it, never lower it). A process that is gone is left alone."""
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < niceness:
                os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:  # the thread ended meanwhile
            pass


def _worker_main(conn: Connection, loader: Callable[[], Callable], run: Callable, niceness: int) -> None:
    """A worker's life: load the function, say so, then score each chunk it is sent until EOF."""
    raise_niceness(os.getpid(), niceness)  # before any thread or sandbox starts: they inherit it
    # Ctrl-C and SIGTERM reach the whole process group: the trainer decides (it finishes the step,
    # saves, and kills its workers); a worker whose parent is gone sees EOF and ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fn = loader()
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            args = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(("done", run(fn, *args)))


class _Worker:
    def __init__(self, loader: Callable, run: Callable, niceness: int) -> None:
        # a child of its own (not multiprocessing's spawn: the user's script is not imported again)
        popen, self.conn = start_child("hybridflow.rewards.worker_pool", (loader, run, niceness))
        self.process = ChildProcess(popen)
        self.ready = False

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=10)
        self.conn.close()


class WorkerPoolFailed(RuntimeError):
    """The workers could not start (the function's module failed to import, or they died)."""


class ScoringPool:
    """`run_chunks(chunks, args, deadline_s)` runs `run(fn, chunk, *args)` for each chunk on `size`
    worker processes and returns, per chunk, ('done', result), ('timeout', None) or ('died', why)."""

    def __init__(
        self, size: int, loader: Callable[[], Callable], run: Callable, *, start_timeout_s: float
    ) -> None:
        self.loader, self.run, self.start_timeout_s = loader, run, start_timeout_s
        self.niceness = os.nice(0)  # the workers' (and their sandboxes'): this process's until raised
        self.workers = [self._spawn() for _ in range(size)]
        atexit.register(self.close)  # before multiprocessing's own exit handler joins its children

    def _spawn(self) -> _Worker:
        return _Worker(self.loader, self.run, self.niceness)

    def run_at_niceness(self, niceness: int) -> None:
        """Workers, their replacements and their sandboxes at `niceness` at least: never ahead of the
        run's Ray workers in the CPU scheduler (a cluster's own, at its niceness)."""
        self.niceness = max(self.niceness, niceness)
        for worker in self.workers:
            if worker.process.is_alive():
                raise_niceness(worker.process.pid, self.niceness)

    def wait_ready(self) -> None:
        """Every worker has loaded the function, or WorkerPoolFailed with the first one's cause."""
        deadline = time.monotonic() + self.start_timeout_s
        for i, worker in enumerate(self.workers):
            while not worker.ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerPoolFailed(f"worker {i} did not start within {self.start_timeout_s:g} s")
                if worker.conn.poll(min(left, 0.5)):  # a message, or the end of a worker that died
                    try:
                        kind, detail = worker.conn.recv()
                    except (EOFError, OSError):
                        worker.process.join(timeout=5)
                        raise WorkerPoolFailed(
                            f"worker {i} exited with code {worker.process.exitcode} while starting"
                        ) from None
                    if kind == "failed":
                        raise WorkerPoolFailed(detail)
                    worker.ready = True

    def _replace(self, index: int) -> None:
        self.workers[index].kill()
        self.workers[index] = self._spawn()

    def run_chunks(
        self, chunks: list[Any], args: tuple, deadline_s: Callable[[Any], float]
    ) -> list[tuple[str, Any]]:
        """Each chunk once: ('done', result), ('timeout', None) past its deadline (the worker is killed
        and replaced), or ('died', why) when its worker died or a replacement could not load."""
        results: list[tuple[str, Any] | None] = [None] * len(chunks)
        queue = list(range(len(chunks)))
        busy: dict[int, tuple[int, float]] = {}  # worker index -> (chunk index, its deadline)
        while queue or busy:
            for w in range(len(self.workers)):
                if not queue or w in busy:
                    continue
                if not self.workers[w].process.is_alive():  # died while idle: replace it
                    self._replace(w)
                worker, chunk = self.workers[w], queue.pop(0)
                try:
                    worker.conn.send((chunks[chunk], *args))
                except OSError:  # its pipe broke: it died just now
                    queue.insert(0, chunk)
                    self._replace(w)
                    continue
                # a fresh worker's clock starts once it has loaded the function (below)
                grace = 0.0 if worker.ready else self.start_timeout_s
                busy[w] = (chunk, time.monotonic() + grace + deadline_s(chunks[chunk]))
            if not busy:
                continue
            nearest = min(deadline for _, deadline in busy.values())
            conns = {self.workers[w].conn: w for w in busy}
            for conn in wait(list(conns), timeout=max(0.0, nearest - time.monotonic())):
                w = conns[conn]
                chunk, _ = busy[w]
                try:
                    kind, detail = conn.recv()
                except (EOFError, OSError):
                    self.workers[w].process.join(timeout=5)
                    kind, detail = (
                        "died",
                        f"the scoring worker died (exit code {self.workers[w].process.exitcode})",
                    )
                if kind == "ready":  # a replacement has loaded the function: the chunk's clock starts
                    self.workers[w].ready = True
                    busy[w] = (chunk, time.monotonic() + deadline_s(chunks[chunk]))
                    continue
                busy.pop(w)
                results[chunk] = ("died", detail) if kind == "failed" else (kind, detail)
                if kind in ("died", "failed"):
                    self._replace(w)
            now = time.monotonic()
            for w, (chunk, deadline) in list(busy.items()):
                if now >= deadline:  # stuck (in C code, or ignoring its alarm): kill it alone
                    busy.pop(w)
                    results[chunk] = ("timeout", None)
                    self._replace(w)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []
        atexit.unregister(self.close)


if __name__ == "__main__":  # a scoring worker: python -m hybridflow.rewards.worker_pool FD
    link = child_link()
    _worker_main(link, *link.recv())
