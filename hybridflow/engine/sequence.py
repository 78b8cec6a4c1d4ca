"""Per-request state of the engine: one `Sequence` per sampled response."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hybridflow.rollout.sampling import NonFiniteLogits, SamplingParams


@dataclass(eq=False)
class Sequence:
    """A prompt plus the tokens sampled so far, and where its K/V live in the paged cache.

    Invariant while running: the K/V of every token but the last are cached (`cached == len(tokens)
    - 1`); the next decode step feeds the last token, caches it and samples the following one.
    """

    seq_id: int
    prompt_index: int
    tokens: list[int]  # prompt + generated
    prompt_len: int
    seed: int  # key of this sequence's sampling noise (31 bits)
    pages: list[int] = field(default_factory=list)  # physical page of each logical page
    row: int = -1  # this sequence's row in the scheduler's page table while running
    cached: int = 0  # tokens whose K/V are in the cache
    kv_epoch: int = 0  # the scheduler's weights epoch when its K/V were computed (kept across updates)
    logprobs: list[float] = field(default_factory=list)
    unscaled_logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    request_id: str = ""
    sample: int = 0  # which of its request's n samples
    params: SamplingParams = field(default_factory=SamplingParams)
    sampling_group: tuple = ()  # sampled.params_key: sequences of equal sampling parameters draw together
    end: int = 1 << 62  # token count at which it stops: prompt + max_tokens, or the context
    reported: int = 0  # generated tokens already handed out by Engine.step()
    page_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full pages
    routes: torch.Tensor | None = None  # finished, with routes recorded: [tokens - 1, MoE layers, k]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PrefillJob:
    """Sequences that share the same tokens to prefill: the n samples of a fresh prompt (prefilled
    once; they share its pages and draw their first tokens from the same logits) or one preempted
    sequence recomputing its K/V."""

    seqs: list[Sequence]

    @property
    def tokens(self) -> list[int]:
        return self.seqs[0].tokens


def record_run(batch: list[Sequence], run: np.ndarray, limits: list[int]) -> list[Sequence]:
    """Append each sequence's tokens of a run (run [steps, 4, B]: token, log-prob, unscaled log-prob,
    stop flag) up to its limit, its first stop or its length (prompt + max_tokens, the context), and
    set the finish reason of those that ended there; returns them (still holding their pages)."""
    steps = run.shape[0]
    limit = np.array(limits)[:, None]  # [B, 1]
    k = np.arange(steps)[None, :]  # [1, steps]
    before = np.array([len(s.tokens) - s.end for s in batch])[:, None]  # [B, 1]: <= -1 while running
    length = before + k + 1 >= 0  # [B, steps]: the token of step k reaches max_tokens or the context
    stop = run[:, 3].T > 0  # [B, steps]
    ends = (stop | length) & (k < limit)
    ended = ends.any(1)  # [B]
    taken = np.where(ended, ends.argmax(1) + 1, limits)  # [B] tokens kept
    kept = (k < taken[:, None]).T  # [steps, B]
    if not (np.isfinite(run[:, 1]) & np.isfinite(run[:, 2]))[kept].all():
        raise NonFiniteLogits("the model produced NaN or inf logits during generation")
    # to Python lists once: per-sequence numpy slicing costs more than the rest of the loop
    tokens, logp = run[:, 0].T.astype(np.int64).tolist(), run[:, 1].T.tolist()  # [B][steps]
    unscaled, stopped = run[:, 2].T.tolist(), stop.tolist()
    finished = []
    for s, n, end, tok, lp, un, st in zip(
        batch, taken.tolist(), ended.tolist(), tokens, logp, unscaled, stopped
    ):
        s.tokens += tok[:n]
        s.logprobs += lp[:n]
        s.unscaled_logprobs += un[:n]
        if end:
            s.finish_reason = "stop" if st[n - 1] else "length"
            finished.append(s)
        else:
            s.cached = len(s.tokens) - 1  # every token but the last is cached
    return finished


def limits_after(batch: list[Sequence], limits: list[int], k: int) -> list[int] | None:
    """The steps each sequence may take in a run of up to k launched right after one of `limits`
    steps whose draws are not read yet (its tokens assumed all kept: a row that stops in it is
    dropped when that run is read): 0 for a sequence already finished or ending by length in it.
    None when a run cannot follow: a live row took fewer steps than the run (its device state went on
    past its tokens), or no row has a step left."""
    steps, after = max(limits), []
    for s, taken in zip(batch, limits):
        left = s.end - len(s.tokens) - taken
        if s.finished or left <= 0:
            after.append(0)
        elif taken < steps:
            return None
        else:
            after.append(min(k, left))
    return after if any(after) else None
