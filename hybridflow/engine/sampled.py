"""Tokens drawn on the device during a run of decode steps, kept there until the run ends: one copy
to the host per run instead of one per token. Each sequence samples with its own request's
parameters: the batch is drawn in groups of equal parameters (one group, the usual case, is one call)."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.engine.sampler import sample
from hybridflow.engine.sequence import Sequence
from hybridflow.rollout.sampling import SamplingParams


def exact_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """logits [b, V], tokens [b] -> log-probs [b] of the tokens at `temperature` and at 1, each from
    the kernel that computes the trainer's (a row per program, the same bits for the same logits)."""
    from hybridflow.models.native.triton_logprobs import chunk_stats

    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    unscaled = chunk_stats(logits, tokens, 1.0)[0]
    if temperature in (0.0, 1.0):  # greedy reports the model's own distribution
        return unscaled, unscaled
    return chunk_stats(logits, tokens, 1.0 / temperature)[0], unscaled


def params_key(p: SamplingParams) -> tuple:
    """What decides how a sequence samples and stops (seeds are per sequence)."""
    return (p.temperature, p.top_p, p.top_k, tuple(sorted(p.stop_token_ids)))


class SampledRun:
    def __init__(
        self, batch: list[Sequence], stops_for, *, steps: int, device, exact: bool = False, ahead=None
    ) -> None:
        """`stops_for(params)` -> the stop token ids [S] on the device for sequences of those params.
        exact: a plain temperature draw's log-probs from the trainer's softmax kernel (exact_logprobs).
        ahead: per row, how many tokens past the sequence's own this row draws (a speculative step
        checks several positions of one sequence at once: each draws with that position's noise)."""
        self.exact = exact
        self.seeds = torch.tensor([s.seed for s in batch], dtype=torch.int64).to(device, non_blocking=True)
        generated = torch.tensor([s.num_generated for s in batch], dtype=torch.int64)
        if ahead is not None:
            generated += torch.as_tensor(ahead, dtype=torch.int64)
        self.generated = generated.to(device, non_blocking=True)  # [B] tokens before the run
        rows: dict[int, list[int]] = {}
        for i, s in enumerate(batch):
            rows.setdefault(s.sampling_group, []).append(i)
        self.groups = [
            (batch[r[0]].params, torch.tensor(r, device=device) if len(rows) > 1 else None, stops_for(batch[r[0]].params))
            for r in rows.values()
        ]  # fmt: skip
        self.out = torch.empty(steps, 4, len(batch), dtype=torch.float64, device=device)
        self._host: torch.Tensor | None = None  # the record on the host (to_host)
        self._copied: torch.cuda.Event | None = None

    def device_draw(self) -> tuple[str, float, torch.Tensor] | None:
        """(mode, temperature, stop ids [S]) when the whole batch draws with one set of parameters
        that the device sampler covers (greedy or plain temperature: no top-k / top-p); else None."""
        if len(self.groups) != 1:
            return None
        params, _, stops = self.groups[0]
        if params.top_k > 0 or params.top_p < 1.0:
            return None
        mode = "greedy" if params.greedy else "unit" if params.temperature == 1.0 else "scaled"
        return mode, params.temperature, stops

    def _draw(self, logits, params, stops, seeds, generated, k) -> tuple[torch.Tensor, torch.Tensor]:
        """-> tokens [b], and [4, b]: token, log-prob, unscaled log-prob, stop flag."""
        tokens, logp, unscaled = sample(logits, params, seeds, generated + k)
        if self.exact and params.top_k <= 0 and params.top_p >= 1.0:
            logp, unscaled = exact_logprobs(logits, tokens, params.temperature)
        stopped = torch.isin(tokens, stops) if stops.numel() else torch.zeros_like(tokens)
        return tokens, torch.stack([tokens.double(), logp.double(), unscaled.double(), stopped.double()])

    def draw(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        """logits [B, V] of step k -> the sampled tokens [B] (recorded with their log-probs)."""
        if len(self.groups) == 1:
            params, _, stops = self.groups[0]
            tokens, self.out[k] = self._draw(logits, params, stops, self.seeds, self.generated, k)
            return tokens
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        for params, rows, stops in self.groups:
            part, drawn = self._draw(
                logits.index_select(0, rows), params, stops, self.seeds[rows], self.generated[rows], k
            )
            tokens[rows] = part
            self.out[k][:, rows] = drawn
        return tokens

    def to_host(self) -> None:
        """The record copied to the host behind the run, on its stream (CUDA: into pinned memory, with
        an event to wait on): a run launched next may then reuse the device buffer it is in."""
        if self.out.is_cuda:
            self._host = torch.empty(self.out.shape, dtype=self.out.dtype, pin_memory=True)
            self._host.copy_(self.out, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:
            self._host = self.out.clone()

    def fetch(self) -> np.ndarray:
        """[steps, 4, B] on the host (the run's one wait: from any thread, on the run's own stream)."""
        if self._copied is not None:
            self._copied.synchronize()
        return (self._host if self._host is not None else self.out.cpu()).numpy()
