"""A speculative step's rows and its outcome, apart from the engine's state: which drafted tokens each
sequence feeds (within its free cache slots and the largest decode graph), a row per fed token, and,
once the rows have drawn, how many tokens each sequence keeps (its drafted tokens up to the first
that differs from the draw there, then that draw)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class VerifyRows:
    drafts: list[list[int]]  # each sequence's drafted tokens as fed
    tokens: list[int]  # per row: the token fed (a sequence's last, then its drafted ones)
    positions: list[int]  # per row: where it goes
    ahead: list[int]  # per row: tokens past the sequence's own (the draw's noise index offset)
    owner: list[int]  # per row: the sequence's index

    @property
    def fed(self) -> list[int]:
        return [len(d) + 1 for d in self.drafts]


def plan_rows(last_tokens: list[int], cached: list[int], drafts: list[list[int]], slots: list[int],
              max_rows: int) -> VerifyRows | None:  # fmt: skip
    """Sequence i feeds its last token at position cached[i] and as much of drafts[i] as its free
    cache slots (slots[i], at least 1) and the rows left under max_rows allow, the earlier sequences
    first. None: no drafted token fits (a plain step instead)."""
    spare, fitted = max_rows - len(last_tokens), []
    for draft, free in zip(drafts, slots):
        fitted.append(draft[: max(min(free - 1, spare), 0)])
        spare -= len(fitted[-1])
    if not any(fitted):
        return None
    rows = VerifyRows(fitted, [], [], [], [])
    for i, (last, at, draft) in enumerate(zip(last_tokens, cached, fitted)):
        for k, token in enumerate((last, *draft)):
            rows.tokens.append(token)
            rows.positions.append(at + k)
            rows.ahead.append(k)
            rows.owner.append(i)
    return rows


def kept_tokens(drawn: np.ndarray, rows: VerifyRows) -> tuple[np.ndarray, list[int]]:
    """drawn [4, rows] (token, log-prob, unscaled log-prob, stop flag per row) -> each sequence's draws
    as a run [most fed, 4, sequences] and how many of them it keeps."""
    fed = rows.fed
    run = np.zeros((max(fed), 4, len(fed)))
    kept, at = [], 0
    for j, (n, draft) in enumerate(zip(fed, rows.drafts)):
        run[:n, :, j] = drawn[:, at : at + n].T
        accepted = 0
        while accepted < len(draft) and int(drawn[0, at + accepted]) == draft[accepted]:
            accepted += 1
        kept.append(accepted + 1)
        at += n
    return run, kept
