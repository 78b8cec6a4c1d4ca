"""Speculative decoding's side of the engine's decode loop: the drafter over the engine's history
(drafter.py), the gate that keeps it only while it measures faster (speculation_gate.py), the
planning of a verifying step's rows and the settling of its draws (verify.py), and the counters.
The engine keeps what touches its state: scheduling, running the model, recording tokens."""

from __future__ import annotations

import numpy as np

from hybridflow.engine.drafter import Drafter, SpeculativeConfig, speculative_batch_for
from hybridflow.engine.sequence import Sequence
from hybridflow.engine.speculation_gate import SpeculationGate
from hybridflow.engine.verify import VerifyRows, kept_tokens, plan_rows

# since the engine was made: speculative steps, the sequences they advanced (rows), tokens drafted,
# drafted tokens accepted, tokens those steps produced; and while few enough run to speculate, the
# milliseconds and tokens of speculating (its steps, and the short runs when nothing drafted) and of
# plain runs (the gate's choice). Milliseconds leave out CUDA graph captures: a bucket's first run
# pays one, which says nothing of the next
COUNTERS = ("steps", "rows", "drafted", "accepted", "tokens", "speculating_ms", "speculating_tokens",
            "plain_ms", "plain_tokens")  # fmt: skip


class Speculation:
    def __init__(self, config: SpeculativeConfig, device) -> None:
        self.drafter = Drafter(config)
        self.gate = SpeculationGate() if config.adaptive else None
        self.max_sequences = config.max_batch_sequences or speculative_batch_for(device)
        self.counts = dict.fromkeys(COUNTERS, 0)

    def applies(self, running: int) -> bool:
        """Whether a decode run over `running` sequences may speculate (few enough run)."""
        return running <= self.max_sequences

    def choose(self, running: int) -> bool | None:
        """For a decode run over `running` sequences: None when too many run to speculate (a plain
        run, not timed); else whether it speculates (the gate's choice, or always without a gate)."""
        if not self.applies(running):
            return None
        return self.gate.speculate() if self.gate is not None else True

    def drafts(self, running: list[Sequence]) -> dict[int, list[int]]:
        """Each running sequence's draft by seq_id (empty where nothing matched or it backs off)."""
        return {s.seq_id: self.drafter.draft(s, s.end - len(s.tokens) - 1) for s in running}

    def plan(self, batch: list[Sequence], drafts: dict[int, list[int]], page_size: int, max_rows: int):
        """The verifying step's rows for the scheduled `batch` (VerifyRows), or None: no drafted token
        fits a free cache slot or a row under max_rows."""
        return plan_rows([s.tokens[-1] for s in batch], [s.cached for s in batch],
                         [drafts.get(s.seq_id, []) for s in batch],
                         [len(s.pages) * page_size - s.cached for s in batch], max_rows)  # fmt: skip

    def settle(self, batch: list[Sequence], rows: VerifyRows, drawn: np.ndarray, record) -> None:
        """The draws of a verifying step (drawn [4, rows]) -> each sequence's run [most fed, 4, B] and
        how many tokens it keeps, handed to record(batch, run, kept) (the engine's, which stops a
        sequence at its stop token or length); the drafter learns which drafts held."""
        run, kept = kept_tokens(drawn, rows)
        for s, draft, n in zip(batch, rows.drafts, kept):
            self.drafter.accepted(s, len(draft), n - 1)
        before = sum(len(s.tokens) for s in batch)
        record(batch, run, kept)
        counts = self.counts
        counts["steps"] += 1
        counts["rows"] += len(batch)
        counts["drafted"] += sum(len(d) for d in rows.drafts)
        counts["accepted"] += sum(kept) - len(kept)
        counts["tokens"] += sum(len(s.tokens) for s in batch) - before

    def plain_steps(self, running: list[Sequence], steps: int) -> int:
        """Steps of the plain run taken when speculation was chosen but nothing drafted: it ends when
        the first sequence may draft again (a draft may match after its next token)."""
        return max(1, min(steps, *(self.drafter.waits_for(s) for s in running)))

    def observe(self, speculated: bool, seconds: float, gained: int, running: int) -> None:
        """A decode run over `running` sequences gained `gained` tokens in `seconds` (graph captures
        left out by the caller)."""
        kind = "speculating" if speculated else "plain"
        self.counts[f"{kind}_ms"] += round(seconds * 1000)
        self.counts[f"{kind}_tokens"] += gained
        if self.gate is not None:
            self.gate.observe(speculated, seconds, gained, running)

    def finished(self, seq: Sequence) -> None:
        """A sequence ended (stopped, reached its length, aborted): its response joins the history."""
        self.drafter.finished(seq)
