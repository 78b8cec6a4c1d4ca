"""Pre-emption and Ctrl-C: the first SIGTERM or SIGINT lets the current step finish, then the
trainer saves a checkpoint and returns normally; a second one acts at once (the previous handlers
are back), which corrupts nothing since checkpoints are written to a temporary folder and renamed."""

from __future__ import annotations

import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulStop:
    """`with GracefulStop() as stop:` ... `if stop.requested:` stop_with_checkpoint and leave the loop.
    saves: whether the run writes checkpoints (trainer.save_freq 0 or -1: none, on a signal neither)."""

    def __init__(self, saves: bool = True) -> None:
        self.requested: str | None = None  # the signal's name once one arrived
        self.saves = saves
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
        then = (
            "saving a checkpoint and stopping"
            if self.saves
            else "stopping (trainer.save_freq: no checkpoints)"
        )
        print(
            f"\n{self.requested}: finishing this step, then {then} (send it again to stop at once)",
            flush=True,
        )

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()


def stop_with_checkpoint(trainer, signal_name: str, saves: bool) -> None:
    """After the step a signal let finish: a checkpoint of it (unless the run writes none, or has just
    written it) and a line saying how to go on. `trainer`: .step, .last_checkpoint, .save()."""
    if not saves:
        print(f"stopped by {signal_name} after step {trainer.step}; no checkpoint written (trainer.save_freq="
              "0 or -1 writes none): the trained weights are not kept", flush=True)  # fmt: skip
        return
    if trainer.last_checkpoint is None or trainer.last_checkpoint.name != f"global_step_{trainer.step}":
        trainer.save()
    print(f"stopped by {signal_name} after step {trainer.step}; checkpoint {trainer.last_checkpoint}. To go on, "
          "run the same command without --overwrite (trainer.resume=auto continues from it)", flush=True)  # fmt: skip
