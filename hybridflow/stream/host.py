"""The local end of the stream of groups, inside the worker that owns the engine (a colocated
training worker or a rollout worker): it runs a GroupStream (stream/local.py) over the worker's engine
and answers the controller's RemoteGroupStream (stream/remote.py). Nothing hands the live engine out
of the worker; the controller reaches these methods as `hosted(StreamHost.method)` through its worker
group, and the worker's own `update_weights` writes into the engine between two of its steps."""

from __future__ import annotations

from collections.abc import Callable

from hybridflow.batch import Prompt, Rollouts
from hybridflow.rollout.sampling import SamplingParams

HOST_ATTRIBUTE = "stream_host"  # the attribute every worker that owns an engine holds its StreamHost in


def hosted(method: Callable) -> str:
    """A StreamHost method as a worker group calls it on a worker (`stream_host.poll`)."""
    return f"{HOST_ATTRIBUTE}.{method.__name__}"


class StreamHost:
    def __init__(self, backend, agent) -> None:
        """`backend`: the worker's rollout engine (the native Engine); `agent`: its agent loop or None."""
        self.backend, self.agent = backend, agent
        self.stream = None

    def can_stream(self) -> bool:
        """Whether the engine takes requests one by one (the native Engine); transformers' and vLLM's
        backends generate whole batches only."""
        from hybridflow.engine import Engine

        return isinstance(self.backend, Engine)

    def open(self, version: int, *, in_flight_updates: bool, deadline_s: float, resume: dict | None = None,
             pause_for_training: bool = False, free_cache_while_paused: bool = False) -> None:  # fmt: skip
        """A GroupStream over the engine, holding policy `version` (see GroupStream for the rest); the
        controller scores what `poll` hands over."""
        from hybridflow.stream.local import GroupStream

        self.close()
        self.stream = GroupStream(
            self.backend,
            agent=self.agent,
            version=version,
            in_flight_updates=in_flight_updates,
            deadline_s=deadline_s,
            resume=resume,
            pause_for_training=pause_for_training,
            free_cache_while_paused=free_cache_while_paused and self.backend.device.type == "cuda",
        )

    def submit(self, prompts: list[Prompt], params: SamplingParams, first_group: int) -> None:
        self.stream.submit(prompts, params, first_group)

    def poll(self) -> tuple[list[tuple[int, Rollouts]], int]:
        """Groups finished since the last poll, and how many are still running."""
        return self.stream.poll(), self.stream.running

    def wait_finished(self, wait_s: float) -> None:
        """Until a group has finished and not been polled (or the stream failed), at most `wait_s`."""
        self.stream.wait_finished(wait_s)

    def run_until(self, group_ids: list[int]) -> None:
        self.stream.run_until(group_ids)

    def update_weights(self, write: Callable, version: int) -> float:
        """`write(engine)` between two engine steps (one_step: once its groups have finished); the
        seconds waited for them. Called by the worker that knows where its weights come from."""
        return self.stream.update_weights(write, version)

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        return self.stream.generate_now(prompts, params)

    def snapshot(self) -> dict | None:
        return self.stream.snapshot()

    def idle_seconds(self) -> float:
        return self.stream.take_idle_seconds()

    def engine_counts(self) -> dict[str, int]:
        return self.stream.take_engine_counts()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
