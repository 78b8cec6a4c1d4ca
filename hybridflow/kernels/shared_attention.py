"""The batch-invariant attention over a shared-prefix packing (models/native/shared_prefix.py: each
prompt packed once, then its responses, their positions continuing from the prompt's length).

Forward: the exact kernel reads a response's keys through a table of its prompt's rows followed by its
own, so each query's bits are those of its separate sequence (a query's result depends on its
position and its keys' values only: kernels/attention.py), and the prompt's tokens run through the
model once for all its responses, as in the ordinary trainer. Backward: the kernels' fixed-order
backward over the separate sequences (each response behind its own copy of its prompt's rows,
gathered), a prompt query's gradient taken from its first copy (the only one whose output was used),
and each prompt key's dK / dV summed over its copies in copy order: the same bits every run."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridflow.kernels.attention import Tiles
from hybridflow.kernels.packed_attention import PackedPages, packed_attention_backward, packed_pages


@dataclass
class SharedPages:
    """The exact kernels' view of a shared-prefix packing: `table` [S, longest] int32 holds segment
    s's keys as packing rows (a response's: its prompt's, then its own) and `tiles` its queries (from
    the prompt's length for a response); the backward's separate sequences are `separate`, rows
    `gather` [Ns] int64 of the packing; `first` [N] int64 is each packing row's first copy there,
    `is_first` [Ns] 1.0 at those; `multi` [M] int64 the rows with several copies (prompts with several
    responses) and `copies` [C, M] int64 their copies in order (Ns where a row has fewer: a zero row)."""

    table: torch.Tensor
    tiles: Tiles
    separate: PackedPages
    gather: torch.Tensor
    first: torch.Tensor
    is_first: torch.Tensor
    multi: torch.Tensor
    copies: torch.Tensor

    def backward(self, q, k, v, out, lse, grad_out):
        """(dq, dk, dv) of the packing, from the separate sequences' fixed-order backward."""
        g = self.gather
        mask = self.is_first.to(grad_out.dtype)[:, None, None]  # [Ns, 1, 1]
        dq, dk, dv = packed_attention_backward(
            q[g], k[g], v[g], out[g], lse[g], grad_out[g] * mask, self.separate
        )  # [Ns, H, D] each
        dq = dq[self.first]  # [N, Hq, D]
        return dq, self._sum_copies(dk), self._sum_copies(dv)

    def _sum_copies(self, grad: torch.Tensor) -> torch.Tensor:
        """[Ns, Hkv, D] over the separate rows -> [N, Hkv, D]: a row's copies summed in copy order."""
        out = grad[self.first]
        if self.multi.numel():
            padded = torch.cat([grad, grad.new_zeros(1, *grad.shape[1:])])  # [Ns + 1, Hkv, D]
            summed = padded[self.copies].float().sum(0)  # [M, Hkv, D]
            out = out.index_copy(0, self.multi, summed.to(grad.dtype))
        return out


def shared_pages(bounds: list[int], groups: list[tuple[int, list[int]]], group: int, device) -> SharedPages:
    """The view of a shared-prefix packing: segment s is rows bounds[s]:bounds[s + 1]; `groups` holds
    (prompt segment, its response segments) as SharedPrefix.groups does; `group`: query heads a KV head."""
    starts = np.asarray(bounds[:-1], dtype=np.int64)
    lengths = np.diff(np.asarray(bounds, dtype=np.int64))
    segments = len(lengths)
    keys: list[np.ndarray] = [np.empty(0, np.int64)] * segments  # each segment's key rows
    firsts = np.zeros(segments, dtype=np.int64)  # each segment's first query position
    separate: list[np.ndarray] = []  # the separate sequences' rows
    for prompt, responses in groups:
        prompt_rows = starts[prompt] + np.arange(lengths[prompt])
        keys[prompt] = prompt_rows
        for r in responses:
            keys[r] = np.concatenate([prompt_rows, starts[r] + np.arange(lengths[r])])
            firsts[r] = lengths[prompt]
            separate.append(keys[r])
        if not responses:
            separate.append(prompt_rows)
    longest = max((len(rows) for rows in keys), default=0)
    table = np.zeros((segments, longest), dtype=np.int32)
    for s, rows in enumerate(keys):
        table[s, : len(rows)] = rows
    tiles = Tiles.of_runs(firsts, starts, lengths, group, device)
    gather = np.concatenate(separate) if separate else np.empty(0, np.int64)  # [Ns]
    order = np.argsort(gather, kind="stable")  # copies of a row in separate-row order
    rows_sorted = gather[order]
    starts_of_row = np.searchsorted(rows_sorted, np.arange(bounds[-1]))
    counts = np.diff(np.append(starts_of_row, len(rows_sorted)))
    if len(counts) and counts.min() < 1:
        raise ValueError("shared_pages: a packed row belongs to no segment of `groups`")
    first = order[starts_of_row]  # [N]
    is_first = np.zeros(len(gather), dtype=np.float32)
    is_first[first] = 1.0
    multi = np.flatnonzero(counts > 1)  # [M]
    copy_count = int(counts.max()) if len(counts) else 0
    copies = np.full((copy_count, len(multi)), len(gather), dtype=np.int64)  # [C, M]
    for c in range(copy_count):
        has = counts[multi] > c
        copies[c, has] = order[starts_of_row[multi[has]] + c]
    separate_bounds = np.concatenate([[0], np.cumsum([len(rows) for rows in separate])]).tolist()

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    return SharedPages(
        on_device(table),
        tiles,
        packed_pages(separate_bounds, group, device),
        on_device(gather),
        on_device(first),
        on_device(is_first),
        on_device(multi),
        on_device(copies),
    )
