"""Pre-emption and Ctrl-C: the first SIGTERM or SIGINT lets the current step finish, then the
trainer saves a checkpoint and returns normally; a second one acts at once (the previous handlers
are back), which corrupts nothing since checkpoints are written to a temporary folder and renamed."""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """`with GracefulStop() as stop:` ... `if stop.requested:` save and leave the loop."""

    def __init__(self) -> None:
        self.requested: str | None = None  # the signal's name once one arrived
        self._previous: dict = {}

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():  # handlers live in the main thread
            # a signal the process ignores (a background job's SIGINT, nohup) stays ignored
            self._previous = {s: h for s in SIGNALS if (h := signal.getsignal(s)) is not signal.SIG_IGN}
            for s in self._previous:
                signal.signal(s, self._handle)
        return self

    def _handle(self, signum: int, frame) -> None:
        self.requested = signal.Signals(signum).name
        self._restore()  # a second signal acts at once
        print(f"\n{self.requested}: finishing this step, then saving a checkpoint and stopping "
              "(send it again to stop at once)", flush=True)  # fmt: skip

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()
