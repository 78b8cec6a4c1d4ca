"""`hybridflow train` with trainer.max_restarts: a run whose worker died or raised starts again from
its latest checkpoint (the same command's resume), a bounded number of times."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from hybridflow.config import Config
from hybridflow.controller.trainer import RLTrainer
from hybridflow.controller.worker_group import WorkerError


def fit_with_restarts(
    config: Config, *, overwrite: bool = False, started: Callable[[RLTrainer], None] | None = None
) -> dict[str, float]:
    """RLTrainer(config).fit(), again from the latest checkpoint after a WorkerError, at most
    trainer.max_restarts times; `started(trainer)` is called with each trainer built."""
    limit = config.trainer.max_restarts
    for attempt in range(limit + 1):
        trainer = None
        try:
            trainer = RLTrainer(
                config, overwrite=overwrite and attempt == 0
            )  # a restart keeps the checkpoints
            if started is not None:
                started(trainer)
            return trainer.fit()
        except WorkerError as e:
            if trainer is not None:
                with contextlib.suppress(Exception):  # the workers still alive give their GPUs back
                    trainer.close()
            if attempt == limit:
                raise
            print(
                f"hybridflow: {str(e).splitlines()[0]}; restart {attempt + 1} of {limit} "
                "(trainer.max_restarts) from the latest checkpoint",
                flush=True,
            )
    raise AssertionError("unreachable")
