"""Drafts for speculative decoding from the RL history itself, no draft model: an n-gram index over
what the engine has seen of a prompt (the prompt, every sample of it in flight, and the responses
to it in earlier calls: an earlier epoch, an earlier turn's request). For each n-gram the table
counts the tokens that followed it; a sequence's draft is built a token at a time, each the one
that most often followed the longest n-gram the text so far (draft included) ends with (the latest
seen among equals), up to k tokens. The most frequent continuation among samples of the model is
the likeliest token, and a drafted token is kept with the model's probability of it, so this keeps
more than copying the latest occurrence (a single draw). The engine verifies drafts in one forward
(engine.py); a draft only decides how many tokens that forward may accept, never which: the output
is the plain engine's.

Adaptive: a sequence that found nothing to draft, or whose draft was rejected at its first token,
twice in a row looks again only after 1, 2, 4 ... more tokens (up to NO_MATCH_BACKOFF when nothing
matched, MAX_BACKOFF when drafts failed), so text with nothing to reuse costs little more than the
lookups."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from hybridflow.engine.sequence import Sequence

MAX_BACKOFF = 64  # tokens a sequence whose drafts keep failing waits at most before drafting again
NO_MATCH_BACKOFF = 8  # ... and one that finds nothing to draft (its text may repeat a little later)


def speculative_batch_for(device) -> int:
    """Most running sequences a speculative step is taken for, by device: a GPU reads a layer's weights
    once for up to a few dozen rows at the same cost (an H100's 0.5B decode step is bound by the weight
    reads to past 64 rows); a CPU's matmuls are bound by arithmetic from a few rows on (this 2-core
    machine: the 135M model at 28 rows), where a rejected row costs what it computes."""
    return 32 if device.type == "cuda" else 4


@dataclass
class SpeculativeConfig:
    num_speculative_tokens: int = 0
    """Tokens drafted per sequence and checked in one forward (vLLM's name); 0: off."""
    prompt_lookup_max: int = 4
    """Longest n-gram matched (vLLM's name for its prompt lookup); shorter ones are tried in turn."""
    prompt_lookup_min: int = 2
    """Shortest n-gram matched."""
    max_batch_sequences: int | None = None
    """Speculate only while at most this many sequences run (the tail of a batch, where a step is
    bound by reading the weights, not by arithmetic: a drafted row costs little); more: plain decode
    runs. None: by device (speculative_batch_for)."""
    history_tokens: int = 4_000_000
    """Tokens of finished responses kept as drafts for the same prompts' later requests (an epoch
    later), the least recently seen prompts dropped first (4 bytes a token)."""
    adaptive: bool = True
    """Speculate only while it measures faster than plain runs in this engine (SpeculationGate: the
    tokens a running sequence gains per second of each, the slower tried now and then); False:
    whenever a sequence has a draft."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0 or (self.max_batch_sequences or 1) < 1 or self.history_tokens < 0:
            raise ValueError(
                "speculative decoding: num_speculative_tokens and history_tokens take 0 or more, "
                "max_batch_sequences 1 or more"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"speculative decoding: prompt_lookup_min ({self.prompt_lookup_min}) must be at least 1 "
                f"and at most prompt_lookup_max ({self.prompt_lookup_max})"
            )

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


@dataclass(eq=False)
class _Pool:
    """What the engine has of one prompt: the sources of drafts and, while any sample of it runs,
    their n-gram table."""

    prompt: list[int]
    # earlier responses, each after the prompt's last prompt_lookup_max tokens (int32)
    history: list[np.ndarray] = field(default_factory=list)
    live: dict[int, Sequence] = field(default_factory=dict)  # samples in flight, by seq_id
    # n-gram -> {next token: times seen}, the latest seen last. Sources: the prompt, each history
    # array, each live sequence's token list (its prompt part not indexed again)
    table: dict[tuple, dict[int, int]] | None = None
    indexed: dict[int, int] = field(default_factory=dict)  # id(source) -> positions indexed so far

    @property
    def history_tokens(self) -> int:
        return sum(len(h) for h in self.history)


class Drafter:
    """The index over the engine's history and each running sequence's drafting state."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._pools: collections.OrderedDict[tuple, _Pool] = collections.OrderedDict()  # LRU order
        self._pool_of: dict[int, _Pool] = {}  # seq_id -> its pool, while it runs
        # seq_id -> (token count to draft again at, misses in a row, that streak's longest wait)
        self._backoff: dict[int, tuple[int, int, int]] = {}
        self._history_tokens = 0

    def _pool(self, seq: Sequence) -> _Pool:
        pool = self._pool_of.get(seq.seq_id)
        if pool is None:
            key = tuple(seq.tokens[: seq.prompt_len])
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _Pool(list(key))
            self._pools.move_to_end(key)
            pool.live[seq.seq_id] = seq  # indexed from the next draft on
            self._pool_of[seq.seq_id] = pool
        return pool

    def _index(self, pool: _Pool, source, start: int) -> None:
        """Index the n-grams of `source` that end before its last token (so each has a continuation),
        from position `start` on (n-grams ending at start or later)."""
        table, lo, hi = pool.table, self.config.prompt_lookup_min, self.config.prompt_lookup_max
        tokens = source if isinstance(source, list) else source.tolist()
        begin = max(pool.indexed.get(id(source), start), start)
        end = len(tokens) - 1
        for i in range(begin, end):  # the n-grams ending at token i; what follows is token i + 1
            following = tokens[i + 1]
            for n in range(lo, min(hi, i + 1) + 1):
                counts = table.setdefault(tuple(tokens[i + 1 - n : i + 1]), {})
                counts[following] = counts.pop(following, 0) + 1  # (re-inserted: the latest seen last)
        pool.indexed[id(source)] = max(begin, end)

    def _table(self, pool: _Pool) -> dict:
        if pool.table is None:  # (re)built: the prompt, the history, then the samples in flight
            pool.table, pool.indexed = {}, {}
            self._index(pool, pool.prompt, 0)
            for response in pool.history:
                self._index(pool, response, 0)
        for seq in pool.live.values():  # the tokens sampled since the last draft
            self._index(pool, seq.tokens, max(len(pool.prompt) - self.config.prompt_lookup_max, 0))
        return pool.table

    def draft(self, seq: Sequence, most: int) -> list[int]:
        """Up to `most` tokens to propose after the sequence's last one ([] when nothing matches, the
        sequence waits out a back-off, or most <= 0)."""
        if most <= 0:
            return []
        if self.waits_for(seq):
            return []
        table = self._table(self._pool(seq))
        hi, lo = self.config.prompt_lookup_max, self.config.prompt_lookup_min
        text = seq.tokens[-hi:]  # the last tokens, then the draft as it grows
        drafted: list[int] = []
        for _ in range(min(most, self.config.num_speculative_tokens)):
            counts = next(
                (c for n in range(min(hi, len(text)), lo - 1, -1) if (c := table.get(tuple(text[-n:])))), None
            )
            if counts is None:
                break
            token = max(reversed(counts), key=counts.__getitem__)  # (the latest seen among equals)
            drafted.append(token)
            text = [*text[1:], token] if len(text) == hi else [*text, token]
        if not drafted:
            self._missed(seq, NO_MATCH_BACKOFF)
        elif seq.seq_id in self._backoff and self._backoff[seq.seq_id][2] == NO_MATCH_BACKOFF:
            del self._backoff[seq.seq_id]  # a streak of finding nothing ends here
        return drafted

    def waits_for(self, seq: Sequence) -> int:
        """Tokens the sequence has yet to sample before it drafts again (0: it drafts now)."""
        wait = self._backoff.get(seq.seq_id)
        return max(wait[0] - len(seq.tokens), 0) if wait is not None else 0

    def accepted(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """After a verify step: a draft rejected at its first token counts as a miss."""
        if not drafted:
            return
        if accepted:
            self._backoff.pop(seq.seq_id, None)
        else:
            self._missed(seq, MAX_BACKOFF)

    def _missed(self, seq: Sequence, most: int) -> None:
        """No draft, or one rejected at its first token: after two misses of a kind in a row the
        sequence waits 1, 2, 4 ... tokens (at most `most`, the kind's) before it looks again."""
        _, misses, kind = self._backoff.get(seq.seq_id, (0, 0, most))
        misses = misses + 1 if kind == most else 1
        wait = min(1 << (misses - 2), most) if misses >= 2 else 0
        self._backoff[seq.seq_id] = (len(seq.tokens) + wait, misses, most)

    def finished(self, seq: Sequence) -> None:
        """A sample ended (or was aborted): its response joins its prompt's history."""
        self._backoff.pop(seq.seq_id, None)
        pool = self._pool_of.pop(seq.seq_id, None)
        if pool is None:
            return
        del pool.live[seq.seq_id]
        self._keep(pool, seq.tokens[seq.prompt_len :])

    def remember(self, prompt: list[int], response: list[int]) -> None:
        """A response to `prompt` from elsewhere (a dataset's reference answer, an earlier engine's
        sample), drafted from as the engine's own are."""
        key = tuple(prompt)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool(list(key))
        self._pools.move_to_end(key)
        kept = self._keep(pool, response)
        if kept is not None and pool.table is not None:  # a table in use takes it in now
            self._index(pool, kept, 0)

    def _keep(self, pool: _Pool, response) -> np.ndarray | None:
        """The response into the pool's history; once no sample of the prompt runs, its table goes
        (rebuilt when the prompt comes back); the least recently seen prompts' history goes past
        `history_tokens`."""
        kept = None
        if self.config.history_tokens and len(response):
            # after the prompt's last tokens, so that the n-grams that begin in the prompt draft too
            tail = pool.prompt[-self.config.prompt_lookup_max :]
            kept = np.asarray([*tail, *response], dtype=np.int32)
            pool.history.append(kept)
            self._history_tokens += len(kept)
        if not pool.live:
            pool.table, pool.indexed = None, {}  # the memory of a table goes with the prompt's last sample
            if not pool.history:
                self._pools.pop(tuple(pool.prompt), None)
        self._trim()
        return kept

    def _trim(self) -> None:
        for key in list(self._pools):  # least recently seen first
            if self._history_tokens <= self.config.history_tokens:
                break
            if not self._pools[key].live:
                self._history_tokens -= self._pools.pop(key).history_tokens
