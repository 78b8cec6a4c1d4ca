"""Training on the samples of a prompt with the prompt packed once.

GRPO-style batches hold n responses per prompt. Packed as n separate sequences, the prompt's tokens
run through the model n times; here each group is packed as [prompt, response 1, ..., response n],
with position ids restarting at the prompt's length for every response, and attention that lets a
response token see the whole prompt and its own response up to itself (never another response).
The result equals the separate sequences' exactly (up to float rounding); the prompt's gradient
gathers what each response sends it.

Attention is two flash-attention calls merged by their log-sum-exps: causal within every segment
(the prompt, each response), and every response token against its group's prompt. Backward runs
flash attention's backward for both parts with the merged output and log-sum-exp, which gives each
part's exact share of the gradient (as ring attention does). Off CUDA: SDPA per segment, exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class SharedPrefix:
    """Where a shared-prefix packing put things. Segments (prompt or response, in packed order) are
    the packing's cu_seqlens; these fields describe the response-to-prompt part."""

    response_rows: torch.Tensor  # [Nr] int64: packed rows of response tokens, group-major
    prompt_rows: torch.Tensor  # [Np] int64: packed rows of prompt tokens of groups with responses
    cu_q: torch.Tensor  # [G + 1] int32: response tokens per group, cumulative
    cu_k: torch.Tensor  # [G + 1] int32: prompt tokens per group, cumulative
    max_q: int
    max_k: int
    groups: list[tuple[int, list[int]]]  # host: (prompt segment, its response segments) per group


@dataclass
class SharedPacking:
    input_ids: torch.Tensor  # [N]
    position_ids: torch.Tensor  # [N]
    cu_seqlens: torch.Tensor  # [S + 1] int32 on the host: every prompt and response segment
    index: torch.Tensor  # [R] the packed row whose hidden state predicts each response token, in order
    shared: SharedPrefix


def has_shared_prompts(prompt_ids: list[list[int]]) -> bool:
    return len({tuple(p) for p in prompt_ids}) < len(prompt_ids)


def pack_shared_prompts(
    prompt_ids: list[list[int]], response_ids: list[list[int]], device: torch.device
) -> SharedPacking:
    """Sequences with equal prompts packed as one group [prompt, responses...] (groups in order of
    first appearance). `index` follows the input order: response token t of sequence b is predicted
    by the prompt's last row (t = 0) or by its response's row t - 1."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, prompt in enumerate(prompt_ids):
        groups.setdefault(tuple(prompt), []).append(b)
    ids: list[int] = []
    positions: list[int] = []
    lengths: list[int] = []
    starts = [0] * len(prompt_ids)  # packed row of each response's first token
    last_prompt_row = [0] * len(prompt_ids)
    group_segments: list[tuple[int, list[int]]] = []
    response_rows: list[int] = []
    prompt_rows: list[int] = []
    q_lengths: list[int] = []
    k_lengths: list[int] = []
    for prompt, members in groups.items():
        p, first = len(prompt), len(ids)
        ids += prompt
        positions += range(p)
        lengths.append(p)
        segment, responses, rows = len(lengths) - 1, [], 0
        for b in members:
            r = response_ids[b]
            last_prompt_row[b], starts[b] = first + p - 1, len(ids)
            if not r:
                continue
            response_rows += range(len(ids), len(ids) + len(r))
            ids += r
            positions += range(p, p + len(r))
            lengths.append(len(r))
            responses.append(len(lengths) - 1)
            rows += len(r)
        group_segments.append((segment, responses))
        if rows:
            prompt_rows += range(first, first + p)
            q_lengths.append(rows)
            k_lengths.append(p)
    index = [
        row
        for b, r in enumerate(response_ids)
        for row in ([last_prompt_row[b]] + list(range(starts[b], starts[b] + len(r) - 1)))[: len(r)]
    ]

    def cumulative(values: list[int], on_device: bool = True) -> torch.Tensor:
        out = torch.zeros(len(values) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(values, dtype=torch.int32), 0)
        return out.to(device) if on_device else out

    def rows_tensor(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(device)

    shared = SharedPrefix(
        response_rows=rows_tensor(response_rows),
        prompt_rows=rows_tensor(prompt_rows),
        cu_q=cumulative(q_lengths),
        cu_k=cumulative(k_lengths),
        max_q=max(q_lengths, default=0),
        max_k=max(k_lengths, default=0),
        groups=group_segments,
    )
    return SharedPacking(
        rows_tensor(ids),
        rows_tensor(positions),
        cumulative(lengths, on_device=False),
        rows_tensor(index),
        shared,
    )


def shared_prefix_attention(q, k, v, layout) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D] of a shared-prefix packing -> [N, Hq, D]; `layout` is the
    model's PackedLayout (its segments and `shared`)."""
    if q.is_cuda:
        return _FlashSharedPrefix.apply(q, k, v, layout)
    return _reference(q, k, v, layout)


def _reference(q, k, v, layout) -> torch.Tensor:
    """SDPA per segment: a prompt causally; a response against [its prompt, itself] with the prompt
    fully visible and itself causal. One split and one cat (no per-segment slice writes)."""
    bounds = layout.bounds
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    qs, ks, vs = (torch.split(t, lengths) for t in (q, k, v))
    outs: list[torch.Tensor | None] = [None] * len(lengths)

    def sdpa(qq, kk, vv, **kw):
        qq, kk, vv = (t.transpose(0, 1)[None] for t in (qq, kk, vv))  # [1, H, L, D]
        return F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True, **kw)[0].transpose(0, 1)

    for prompt, responses in layout.shared.groups:
        outs[prompt] = sdpa(qs[prompt], ks[prompt], vs[prompt], is_causal=True)
        p = lengths[prompt]
        for r in responses:
            n = lengths[r]
            mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device)  # [n, P + n]
            mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            kk, vv = torch.cat([ks[prompt], ks[r]]), torch.cat([vs[prompt], vs[r]])
            outs[r] = sdpa(qs[r], kk, vv, attn_mask=mask)
    return torch.cat(outs)


def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale
    )
    return out, lse, rng, unused  # out [N, Hq, D]; lse [Hq, N] float32


def _flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, rng, unused, scale):
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused, scale=scale
    )  # dq [N, Hq, D], dk and dv [N, Hkv, D]


class _FlashSharedPrefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout):
        s, scale = layout.shared, q.shape[-1] ** -0.5
        rr, pr = s.response_rows, s.prompt_rows
        cu, n = layout.cu_seqlens, layout.max_len
        out, lse, rng, unused = _flash_forward(q, k, v, cu, cu, n, n, True, scale)  # within segments
        if rr.numel():
            cross, cross_lse, _, _ = _flash_forward(
                q.index_select(0, rr), k.index_select(0, pr), v.index_select(0, pr),
                s.cu_q, s.cu_k, s.max_q, s.max_k, False, scale,
            )  # fmt: skip
            own_lse = lse.index_select(1, rr)  # [Hq, Nr]
            merged = torch.logaddexp(own_lse, cross_lse)  # [Hq, Nr]
            w_own = torch.exp(own_lse - merged).T[..., None]  # [Nr, Hq, 1]
            w_cross = torch.exp(cross_lse - merged).T[..., None]
            mixed = out.index_select(0, rr).float() * w_own + cross.float() * w_cross  # [Nr, Hq, D]
            out = out.index_copy(0, rr, mixed.to(out.dtype))
            lse = lse.index_copy(1, rr, merged)
        ctx.save_for_backward(q, k, v, out, lse, rng, unused)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, rng, unused = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        s, cu, n = layout.shared, layout.cu_seqlens, layout.max_len
        grad_out = grad_out.contiguous()
        # each part's backward with the merged output and log-sum-exp: its exact share of the gradient
        dq, dk, dv = _flash_backward(grad_out, q, k, v, out, lse, cu, cu, n, n, True, rng, unused, scale)
        rr, pr = s.response_rows, s.prompt_rows
        if rr.numel():
            dq_c, dk_c, dv_c = _flash_backward(
                grad_out.index_select(0, rr), q.index_select(0, rr), k.index_select(0, pr),
                v.index_select(0, pr), out.index_select(0, rr), lse.index_select(1, rr).contiguous(),
                s.cu_q, s.cu_k, s.max_q, s.max_k, False, rng, unused, scale,
            )  # fmt: skip
            dq = dq.index_add(0, rr, dq_c)
            dk = dk.index_add(0, pr, dk_c)
            dv = dv.index_add(0, pr, dv_c)
        return dq, dk, dv, None
