"""Training on the samples of a prompt with the prompt packed once.

GRPO-style batches hold n responses per prompt. Packed as n separate sequences, the prompt's tokens
run through the model n times; here each prompt is packed once (all prompts, then all responses),
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

from hybridflow.devices import to_device


@dataclass
class SharedPrefix:
    """Where a shared-prefix packing put things. Segments (prompt or response, in packed order) are
    the packing's cu_seqlens; these fields describe the response-to-prompt part. The packing holds
    every prompt first and then every response, group-major, so both sides of that part are
    contiguous row ranges (slices, not gathers)."""

    responses_start: int  # rows [responses_start, N): response tokens, group-major
    prompts_end: int  # rows [0, prompts_end): prompts of the groups with responses, in the same order
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
    """Sequences with equal prompts packed once per group: [prompt of group 1, ..., prompt of group G,
    responses of group 1, ..., responses of group G] (groups in order of first appearance, those with
    only empty responses last among the prompts). `index` follows the input order: response token t
    of sequence b is predicted by its prompt's last row (t = 0) or by its response's row t - 1."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for b, prompt in enumerate(prompt_ids):
        groups.setdefault(tuple(prompt), []).append(b)
    # groups that have responses first: their prompts are then one contiguous key range
    ordered = sorted(groups.items(), key=lambda g: not any(response_ids[b] for b in g[1]))
    ids: list[int] = []
    positions: list[int] = []
    lengths: list[int] = []
    last_prompt_row = [0] * len(prompt_ids)
    prompt_segment: list[int] = []
    k_lengths: list[int] = []
    for prompt, members in ordered:
        p = len(prompt)
        for b in members:
            last_prompt_row[b] = len(ids) + p - 1
        if any(response_ids[b] for b in members):
            k_lengths.append(p)
        prompt_segment.append(len(lengths))
        ids += prompt
        positions += range(p)
        lengths.append(p)
    prompts_end, responses_start = sum(k_lengths), len(ids)
    starts = [0] * len(prompt_ids)  # packed row of each response's first token
    group_segments: list[tuple[int, list[int]]] = []
    q_lengths: list[int] = []
    for (prompt, members), segment in zip(ordered, prompt_segment):
        responses, rows = [], 0
        for b in members:
            r = response_ids[b]
            if not r:
                continue
            starts[b] = len(ids)
            ids += r
            positions += range(len(prompt), len(prompt) + len(r))
            lengths.append(len(r))
            responses.append(len(lengths) - 1)
            rows += len(r)
        group_segments.append((segment, responses))
        if rows:
            q_lengths.append(rows)
    index = [
        row
        for b, r in enumerate(response_ids)
        for row in ([last_prompt_row[b]] + list(range(starts[b], starts[b] + len(r) - 1)))[: len(r)]
    ]

    def cumulative(values: list[int], on_device: bool = True) -> torch.Tensor:
        out = torch.zeros(len(values) + 1, dtype=torch.int32)
        out[1:] = torch.cumsum(torch.tensor(values, dtype=torch.int32), 0)
        return to_device(out, device) if on_device else out

    def rows_tensor(values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), device)

    shared = SharedPrefix(
        responses_start=responses_start,
        prompts_end=prompts_end,
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
        r, p = slice(s.responses_start, None), slice(0, s.prompts_end)  # responses, their prompts
        cu, n = layout.cu_seqlens, layout.max_len
        out, lse, rng, unused = _flash_forward(q, k, v, cu, cu, n, n, True, scale)  # within segments
        if s.max_q:
            cross, cross_lse, _, _ = _flash_forward(
                q[r], k[p], v[p], s.cu_q, s.cu_k, s.max_q, s.max_k, False, scale
            )  # responses against their prompt: [Nr, Hq, D], [Hq, Nr]
            own_lse = lse[:, r]  # [Hq, Nr]
            merged = torch.logaddexp(own_lse, cross_lse)  # [Hq, Nr]
            w_own = torch.exp(own_lse - merged).T[..., None]  # [Nr, Hq, 1]
            w_cross = torch.exp(cross_lse - merged).T[..., None]
            out[r] = (out[r].float() * w_own + cross.float() * w_cross).to(out.dtype)  # [Nr, Hq, D]
            lse[:, r] = merged
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
        if s.max_q:
            r, p = slice(s.responses_start, None), slice(0, s.prompts_end)
            dq_c, dk_c, dv_c = _flash_backward(
                grad_out[r], q[r], k[p], v[p], out[r], lse[:, r].contiguous(),
                s.cu_q, s.cu_k, s.max_q, s.max_k, False, rng, unused, scale,
            )  # fmt: skip
            dq[r] += dq_c
            dk[p] += dk_c
            dv[p] += dv_c
        return dq, dk, dv, None
