"""Generation as a stream of groups, inside the worker that owns the engine (stream/host.py).

A group is one prompt's `n` samples. The trainer admits the groups of a step (`submit`); they are
generated on the rollout engine by a thread of their own (an event loop driving `AsyncEngine`), and
held until they are handed over (`poll`: the controller's RemoteGroupStream scores them) or taken
(`take`, in admission order). Meanwhile the trainer updates its weights, and `update_weights` puts them into the engine
between two engine steps: with `in_flight_updates` (streaming) at once, sequences in flight keep their
tokens and go on with the new weights; without (one_step) once every admitted group has finished.
With `pause_for_training` (one device for both) the engine generates only until the groups the trainer
asks for next (`run_until`) have finished, then pauses between two of its steps until the trainer asks
again, after its update: the two never contend for the device, and where the engine pauses is set by
its own steps, not by the trainer's timing, so such a run is the same run every time (and after a
resume from a checkpoint).

Versions: the engine counts its weight writes (several per update when a sharded actor sends one
layer at a time); the stream maps that count to the policy version (updates applied), so every
sampled token says which policy sampled it.

Checkpoints: `snapshot()` reads, between two engine steps, every admitted group not yet taken — its
samples' tokens, log-probs, versions and finish (and a finished sample's recorded experts) — and a
stream opened with `resume=` that snapshot continues each group from there when it is submitted again
(finished ones are only scored again; unfinished samples draw what they would have drawn next). Agent
episodes in flight start over.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import threading
import time
from concurrent.futures import Future
from dataclasses import replace

from hybridflow.agents.runner import CALLS_PER_EPISODE, run_episodes
from hybridflow.batch import Prompt, Rollouts
from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.engine.requests import SampleSoFar
from hybridflow.errors import UserError
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.stream.buffer import GroupBuffer, SampleRecord, finished_records, fresh_records


class GroupStream(GroupBuffer):
    def __init__(
        self,
        engine,
        *,
        agent=None,
        version: int,
        in_flight_updates: bool,
        deadline_s: float,
        resume: dict | None = None,
        pause_for_training: bool = False,
        free_cache_while_paused: bool = False,
    ) -> None:
        """`engine`: the native Engine (its own weights, not the trainer's module); `agent`: an agent loop (each sample a multi-turn
        episode) or None; `version`: the policy version its weights hold; `resume`: a `snapshot()`
        of the run this one continues; `pause_for_training`: the engine generates only while the trainer
        waits (`run_until`), and with `free_cache_while_paused` sleeps meanwhile (its KV pool freed for
        training, the sequences in flight prefilled again after the update, as they would be anyway)."""
        super().__init__(deadline_s)
        self._records: dict[int, list[SampleRecord]] = {}  # groups sampling now (the loop's)
        self._resume = {
            int(g): [SampleRecord.from_json(d) for d in samples] for g, samples in (resume or {}).items()
        }
        self.engine, self.agent = engine, agent
        self.in_flight_updates, self.version = in_flight_updates, version
        self._engine_versions = [engine.weight_version]  # engine count at which each policy version began
        self._policy_versions = [version]
        self._counted = engine.counters()
        self.pause_for_training, self.free_cache_while_paused = pause_for_training, free_cache_while_paused
        # the loop's: groups entered (their requests reach the engine at once), groups whose samples all
        # finished, the groups whose generation the trainer waits for (None: it never pauses; empty:
        # nothing yet), validation batches beside the stream
        self._started: set[int] = set()
        self._generated: set[int] = set()
        self._target: set[int] | None = set() if pause_for_training else None
        self._holds = 0
        if pause_for_training:  # until the trainer's first run_until
            self._pause_engine()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="hybridflow-groups", daemon=True)
        self._thread.start()
        # generating beside the trainer's kernels needs a device stream of its own; a paused one does not
        self.front = AsyncEngine(engine, own_device_stream=not pause_for_training)

    # ---- the trainer's side ----------------------------------------------------------------------
    def submit(
        self, prompts: list[Prompt], params: SamplingParams, first_group: int, offset: int = 0
    ) -> None:
        """Admit one group per prompt (group ids first_group..): prompt i's sample j draws from
        (params.seed, params.first_sequence + i * n + j), as a synchronous step's would. `offset`:
        these are the step's prompts from that position on (a step admitted in parts), which draw
        and are numbered as they would in one call."""
        params, first_group = self._params_of(params, offset), first_group + offset
        self._admitted(range(first_group, first_group + len(prompts)))
        asyncio.run_coroutine_threadsafe(self._groups(prompts, params, first_group), self.loop)

    def run_until(self, group_ids: list[int]) -> None:
        """Pausing for training: the engine goes on (with every admitted group) until these groups'
        samples have all finished, and pauses between that step and the next."""
        if self.pause_for_training:
            self._wait(asyncio.run_coroutine_threadsafe(self._run_until(set(group_ids)), self.loop))

    def poll(self) -> list[tuple[int, Rollouts]]:
        """The groups finished since the last poll, handed over (the controller scores them)."""
        with self._changed:
            self._raise_error()
            done, self._finished = self._finished, {}
        return [(g, f.rollouts) for g, f in sorted(done.items())]

    def update_weights(self, write, version: int) -> float:
        """`write(engine)` between two engine steps, then the engine holds policy `version`. Without
        in-flight updates, first waits until no admitted group is running. Returns the seconds waited."""
        start = time.perf_counter()
        if not self.in_flight_updates:
            with self._changed:
                done = self._changed.wait_for(
                    lambda: self._error is not None or not self._running, self.deadline_s
                )
                self._raise_error()
                if not done:
                    raise UserError(
                        f"generation did not finish within {self.deadline_s:.0f} s (trainer.watchdog_s)"
                    )
        waited = time.perf_counter() - start

        def apply(engine):
            write(engine)
            self._engine_versions.append(engine.weight_version)
            self._policy_versions.append(version)

        self._call(apply)
        self.version = version
        return waited

    def take_engine_counts(self) -> dict[str, int]:
        """The engine's counters since the last call (Engine.counters): tokens of sequences in flight
        prefilled again (after a weight update unless rollout.keep_kv_on_weight_update, a preemption
        for room, a resume, a validation), and speculative decoding's steps, drafts and acceptances."""
        now = self.engine.counters()
        taken = {k: v - self._counted.get(k, 0) for k, v in now.items()}
        self._counted = now
        return taken

    def snapshot(self) -> dict | None:
        """Every admitted group not taken yet, as JSON: group id -> its samples so far (a group that
        has not started is left out: it starts afresh). None with an agent loop (its episodes are
        not kept: they start over)."""
        if self.agent is not None or self.loop.is_closed():  # (closed: the run ended, nothing in flight)
            return None

        def read(_engine) -> dict:  # on the loop, between two engine steps: the records are whole
            with self._changed:
                finished = {g: f.rollouts for g, f in self._finished.items()}
            groups = {g: [r.as_json() for r in records] for g, records in self._records.items()}
            for g, r in finished.items():
                groups[g] = finished_records(r)
            return {str(g): samples for g, samples in sorted(groups.items())}

        return self._wait(
            asyncio.run_coroutine_threadsafe(self.front.between_steps(read, on_loop=True), self.loop)
        )

    def generate_now(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        """A batch beside the stream's groups on the same engine (validation), returned when done."""
        return self._wait(asyncio.run_coroutine_threadsafe(self._held_batch(prompts, params), self.loop))

    def close(self) -> None:
        if self.loop.is_closed():
            return
        pending = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        try:
            pending.result(timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=60)
            self.loop.close()
            if self.pause_for_training:  # the engine outlives the stream (validation after the run)
                self.engine.resume()

    # ---- the stream's thread -------------------------------------------------------------------
    async def _groups(self, prompts: list[Prompt], params: SamplingParams, first_group: int) -> None:
        try:
            await asyncio.gather(
                *(
                    self._group(prompt, self._params_of(params, i), first_group + i)
                    for i, prompt in enumerate(prompts)
                )
            )
        except BaseException as e:  # the engine failed
            self._failed(e)
            raise

    async def _group(self, prompt: Prompt, params: SamplingParams, group_id: int) -> None:
        self._started.add(group_id)  # (its requests reach the engine before this coroutine first waits)
        if self.agent is not None:
            rollouts = await self._episodes(prompt, params, group_id)
            self._group_generated(group_id)
        else:
            records = self._resume.pop(group_id, None) or fresh_records(params.n)
            self._records[group_id] = records  # read by snapshot() until the group is done
            if all(r.finish for r in records):  # finished before a resume: only scored again
                self._group_generated(group_id)
            rollouts = await self._sample(
                prompt, params, records, group_id, on_generated=lambda: self._group_generated(group_id)
            )
        self._done(group_id, rollouts, None)  # scored where it is handed over (the controller's)
        self._records.pop(group_id, None)
        self._started.discard(group_id)

    def _params_of(self, params: SamplingParams, i: int) -> SamplingParams:
        """Prompt i's sampling streams, as in one batch call (an episode takes CALLS_PER_EPISODE)."""
        stride = params.n * (CALLS_PER_EPISODE if self.agent is not None else 1)
        return replace(params, first_sequence=params.first_sequence + i * stride)

    async def _sample(
        self,
        prompt: Prompt,
        params: SamplingParams,
        records: list[SampleRecord],
        group_id: int,
        on_generated=None,
    ) -> Rollouts:
        """The prompt's samples, each going on from its record (empty: from the start), the records
        kept current at every engine step; `on_generated()` in the step where the last one finishes."""

        def record(out) -> None:
            r = records[out.sample]
            r.ids += out.token_ids
            r.logprobs += out.logprobs
            r.versions += [self._policy_version(out.weight_version)] * len(out.token_ids)
            r.finish = out.finish_reason or r.finish
            if out.routed_experts is not None:
                r.routes = out.routed_experts
            if out.finish_reason is not None and on_generated is not None and all(x.finish for x in records):
                on_generated()

        if not all(r.finish for r in records):
            so_far = [SampleSoFar(r.ids, r.logprobs, r.finish) if r.ids else None for r in records]
            resume = so_far if any(so_far) else None
            async for _ in self.front.stream(
                prompt.token_ids, params, every_step=False, on_output=record, resume=resume, hand_over=False
            ):
                pass
        return Rollouts(
            prompt_ids=[prompt.token_ids] * params.n,
            response_ids=[r.ids for r in records],
            response_logprobs=[r.logprobs for r in records],
            finish_reasons=[r.finish or "" for r in records],
            group_ids=[group_id] * params.n,
            prompts=[prompt] * params.n,
            policy_versions=[r.versions for r in records],
            routed_experts=[r.routes for r in records]
            if any(r.routes is not None for r in records)
            else None,
        )

    async def _episodes(self, prompt: Prompt, params: SamplingParams, group_id: int) -> Rollouts:
        """The group's multi-turn episodes; tokens the policy did not sample carry version -1."""
        episodes = await run_episodes(self.agent, [prompt], self.front, params, first_group=group_id)
        rollouts = episodes.rollouts
        rollouts.scores = episodes.scores if any(s is not None for s in episodes.scores) else None
        rollouts.policy_versions = [
            [self._policy_version(v) if v >= 0 else -1 for v in segment.weight_versions]
            for segments in episodes.episodes
            for segment in segments
        ]  # the rows' order: episode by episode, segment by segment
        return rollouts

    async def _all_admitted_started(self) -> None:
        """Until every admitted group's requests have reached the engine's queue (they do before the
        engine's next step): what the engine runs next is then the same in every run."""
        deadline = time.monotonic() + self.deadline_s
        for turn in itertools.count():
            with self._changed:
                if self._error is not None or self._running <= self._started:
                    return
            if time.monotonic() > deadline:
                raise UserError(
                    f"admitted groups did not start within {self.deadline_s:.0f} s (trainer.watchdog_s)"
                )
            await asyncio.sleep(0 if turn < 100 else 0.001)  # a turn of the loop is enough; never spin long

    async def _run_until(self, target: set[int]) -> None:
        await self._all_admitted_started()

        def start(engine) -> None:
            self._generated -= self._target  # trained on by now
            self._target = target
            self._resume_engine()
            self._maybe_pause()

        await self.front.between_steps(start, on_loop=True)

    async def _held_batch(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        """A batch that runs a paused engine until it is done, the stream's groups set aside meanwhile
        (so that where they stand after it is the same in every run); beside an engine that does not
        pause, the stream's groups step too."""
        if self.pause_for_training:
            await self._all_admitted_started()

        def hold(engine) -> None:
            self._holds += 1
            if self.pause_for_training and self._holds == 1:
                engine.set_aside()
            self._resume_engine()

        def release(engine) -> None:
            self._holds -= 1
            if self.pause_for_training and not self._holds:
                engine.bring_back()
            self._maybe_pause()

        await self.front.between_steps(hold, on_loop=True)
        try:
            return await self._batch(prompts, params, 0)
        finally:
            await self.front.between_steps(release, on_loop=True)

    def _group_generated(self, group_id: int) -> None:
        """On the loop, between two engine steps: the group's samples have all finished."""
        if self._target is not None:
            self._generated.add(group_id)
            self._maybe_pause()

    def _maybe_pause(self) -> None:
        """Pause the engine (before its next step) once what the trainer waits for has been generated,
        unless a batch beside the stream still runs."""
        if self._target is None or self._holds or self.engine.paused or not self._target <= self._generated:
            return
        self._pause_engine()

    def _pause_engine(self) -> None:
        self.engine.pause()
        if self.free_cache_while_paused:
            self.engine.sleep()
        with self._changed:
            self._paused = True
            self._tick_idle_clock()

    def _resume_engine(self) -> None:
        if self.engine.paused:
            if self.engine.asleep:
                self.engine.wake()
            self.engine.resume()
            with self._changed:
                self._paused = False
                self._tick_idle_clock()

    async def _batch(self, prompts: list[Prompt], params: SamplingParams, first_group: int) -> Rollouts:
        parts = await asyncio.gather(
            *(
                self._sample(p, self._params_of(params, i), fresh_records(params.n), first_group + i)
                for i, p in enumerate(prompts)
            )
        )
        return Rollouts.concat(list(parts))

    def _policy_version(self, engine_version: int) -> int:
        """The policy version whose weights the engine held at its weight count `engine_version`."""
        return self._policy_versions[bisect.bisect_right(self._engine_versions, engine_version) - 1]

    async def _shutdown(self) -> None:
        for task in asyncio.all_tasks(self.loop):
            if task is not asyncio.current_task():
                task.cancel()
        await self.front.aclose()

    # ---- helpers ------------------------------------------------------------------------------------
    def _call(self, fn):
        return self._wait(asyncio.run_coroutine_threadsafe(self.front.between_steps(fn), self.loop))

    def _wait(self, future: Future):
        try:
            return future.result(timeout=self.deadline_s)
        except TimeoutError:
            future.cancel()
            raise UserError(
                f"the rollout engine did not answer within {self.deadline_s:.0f} s (trainer.watchdog_s)"
            ) from None
