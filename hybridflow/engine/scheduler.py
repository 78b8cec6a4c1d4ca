"""Continuous batching: admit prompts while pages and the prefill token budget allow, decode every
running sequence, free a finished sequence's pages at once, preempt by recompute when pages run out.
With the prefix cache, a job starts from the cached pages of its longest known prefix (the next turn
of a conversation, a shared system prompt, a preempted sequence coming back) and a sequence's full
pages are registered when it lets go of them."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from hybridflow.engine.kv_cache import KVCache
from hybridflow.engine.prefix_cache import extend_page_hashes
from hybridflow.engine.sequence import PrefillJob, Sequence


class Scheduler:
    def __init__(
        self,
        cache: KVCache,
        *,
        max_sequences: int,
        max_prefill_tokens: int,
        max_pages_per_sequence: int,
        prefix_cache: bool = True,
    ) -> None:
        self.cache, self.pool, self.page_size = cache, cache.pool, cache.page_size
        self.max_sequences = max_sequences
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[PrefillJob] = deque()
        self.aside: deque[PrefillJob] = deque()  # out of the schedule until bring_back()
        self.running: dict[int, Sequence] = {}  # by seq_id, in admission order
        self.preemptions = 0
        self.admitted_tokens = 0  # tokens of the jobs admitted to prefill
        self.cached_tokens = 0  # of those, the ones found in the prefix cache (not computed)
        self.kv_epoch = 0  # +1 at each weight update that keeps the running sequences' K/V
        # The page table on the host: one row per running sequence, updated as pages change, so a
        # decode step gathers its rows in one vectorised copy.
        self.table = np.zeros((max_sequences, max_pages_per_sequence), dtype=np.int32)
        self._free_rows = list(range(max_sequences - 1, -1, -1))

    def _assign_row(self, seq: Sequence) -> None:
        seq.row = self._free_rows.pop()
        self.table[seq.row, : len(seq.pages)] = seq.pages

    def _release_row(self, seq: Sequence) -> None:
        self._free_rows.append(seq.row)
        seq.row = -1

    def add(self, job: PrefillJob) -> None:
        self.waiting.append(job)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def schedule_prefill(self) -> list[PrefillJob]:
        """Admit waiting jobs (prefill has priority, as in nano-vllm) and give each its pages; the
        samples of a prompt share them. Needs room for the prompt and for every sample's first decode
        step: a fresh page each after a full last page; after a partial one, a private copy of it for
        all samples but one (the last to write keeps it). A job's sequences start with `cached`
        tokens whose K/V the prefix cache already holds (never the last: its logits are needed)."""
        jobs: list[PrefillJob] = []
        tokens = 0
        while self.waiting:
            job = self.waiting[0]
            n, length = len(job.seqs), len(job.tokens)
            if len(self.running) + n > self.max_sequences:
                break
            found = self._cached_prefix(job)
            new = length - len(found) * self.page_size
            if jobs and tokens + new > self.max_prefill_tokens:
                self.pool.release(found)
                break
            first_steps = n if length % self.page_size == 0 else n - 1
            if self._pages_for(length) - len(found) + first_steps > self.pool.num_free:
                self.pool.release(found)
                break
            self.waiting.popleft()
            pages = found + [self.pool.allocate() for _ in range(self._pages_for(length) - len(found))]
            for i, seq in enumerate(job.seqs):
                if i:
                    for page in pages:
                        self.pool.share(page)
                    seq.page_keys = list(job.seqs[0].page_keys)
                seq.pages, seq.cached = list(pages), len(found) * self.page_size
                seq.kv_epoch = self.kv_epoch
                self._assign_row(seq)
            self.running.update((s.seq_id, s) for s in job.seqs)
            jobs.append(job)
            tokens += new
            self.admitted_tokens += length
            self.cached_tokens += length - new
        return jobs

    def _cached_prefix(self, job: PrefillJob) -> list[int]:
        """The pages of the job's longest cached prefix of full pages, now held by the job."""
        if not self.prefix_cache:
            return []
        first = job.seqs[0]
        usable = (len(first.tokens) - 1) // self.page_size  # the last token is always computed
        return self.pool.lookup(extend_page_hashes(first.page_keys, first.tokens, self.page_size, usable))

    def register(self, seq: Sequence) -> None:
        """Name the sequence's full pages: the K/V of every token but the last are computed (running,
        or finished: a decode run's steps past its stop write beyond the kept tokens only). Not those
        of a sequence whose K/V were computed before a weight update that kept them."""
        if self.prefix_cache and seq.kv_epoch == self.kv_epoch:
            full = (len(seq.tokens) - 1) // self.page_size
            keys = extend_page_hashes(seq.page_keys, seq.tokens, self.page_size, full)
            self.pool.register(seq.pages[:full], keys[:full])

    def schedule_decode(self, want: Callable[[Sequence], int] | None = None) -> list[Sequence]:
        """Give every running sequence writable cache slots for its next `want(seq)` tokens (default
        1): new pages, and a private copy of a shared last page. A sequence gets fewer when pages run
        short, at least one: if even that fails, the newest sequences are preempted. A sequence's
        slots are then `len(seq.pages) * page_size - seq.cached`."""
        ready: list[Sequence] = []
        ps, refs, preempted = self.page_size, self.pool.refs, self.preemptions
        for seq in list(self.running.values()):
            wanted = want(seq) if want is not None else 1
            if seq.cached + wanted <= len(seq.pages) * ps and refs[seq.pages[-1]] == 1:  # the common case
                ready.append(seq)
                continue
            if seq.seq_id not in self.running:  # preempted below
                continue
            while not self._make_room(seq, wanted):
                victim = next(reversed(self.running.values()))
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                ready.append(seq)
        if self.preemptions == preempted:
            return ready
        return [s for s in ready if s.seq_id in self.running]

    def reserve(self, seq: Sequence, slots: int) -> bool:
        """Fresh pages until the sequence's pages hold `slots` tokens' K/V (its last page is its own: a
        decode run gave it that); False, with what it got kept, when the pool runs out first. No
        preemption: a run launched ahead takes only pages that are free."""
        while len(seq.pages) * self.page_size < slots:
            if not self.pool.num_free:
                return False
            seq.pages.append(self.pool.allocate())
            self.table[seq.row, len(seq.pages) - 1] = seq.pages[-1]
        return True

    def _make_room(self, seq: Sequence, wanted: int) -> bool:
        """Slots for up to `wanted` more tokens, at least one (False: not even one page is free)."""
        ps = self.page_size
        if seq.cached < len(seq.pages) * ps and self.pool.refs[seq.pages[-1]] > 1:
            # copy-on-write of the shared partial page
            if not self.pool.num_free:
                return False
            page = self.pool.allocate()
            self.cache.copy_page(seq.pages[-1], page)
            self.pool.release([seq.pages[-1]])
            seq.pages[-1] = page
            self.table[seq.row, len(seq.pages) - 1] = page
        while seq.cached + wanted > len(seq.pages) * ps and self.pool.num_free:  # fresh pages
            seq.pages.append(self.pool.allocate())
            self.table[seq.row, len(seq.pages) - 1] = seq.pages[-1]
        return seq.cached < len(seq.pages) * ps

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's pages; it is prefilled again (prompt + tokens so far) when room returns."""
        del self.running[seq.seq_id]
        self.register(seq)
        self.pool.release(seq.pages)
        self._release_row(seq)
        seq.pages, seq.cached = [], 0
        self.waiting.appendleft(PrefillJob([seq]))
        self.preemptions += 1

    def drop_waiting(self, seqs: list[Sequence]) -> None:
        """Forget the waiting jobs of these sequences (an aborted request's)."""
        gone = {s.seq_id for s in seqs}
        self.waiting = deque(job for job in self.waiting if job.seqs[0].seq_id not in gone)
        self.aside = deque(job for job in self.aside if job.seqs[0].seq_id not in gone)

    def preempt_all(self) -> None:
        """Every running sequence back to waiting, in admission order (its K/V to be recomputed)."""
        for seq in reversed(list(self.running.values())):
            self._preempt(seq)

    def weights_changed(self, keep_kv: bool) -> None:
        """New weights: every running sequence is prefilled again (its K/V recomputed) at its next
        step, or, `keep_kv`, goes on from the K/V it has, never to be named in the prefix cache."""
        if keep_kv:
            self.kv_epoch += 1
        else:
            self.preempt_all()

    def set_aside(self) -> None:
        """Every job in flight or waiting out of the schedule (K/V freed, tokens kept) until
        bring_back(): jobs added meanwhile run alone."""
        self.preempt_all()
        self.aside.extend(self.waiting)
        self.waiting = deque()

    def bring_back(self) -> None:
        """The jobs set aside back, ahead of those waiting now, in their order."""
        self.waiting = deque([*self.aside, *self.waiting])
        self.aside = deque()

    def finish(self, seq: Sequence) -> None:
        del self.running[seq.seq_id]
        self.register(seq)
        self.pool.release(seq.pages)
        self._release_row(seq)
        seq.pages = []
