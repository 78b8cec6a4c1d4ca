"""Prompts packed once for their group of responses: the same log-probs and gradients as separate
sequences, on the CPU path and in the CUDA path's merge of two flash-attention parts (checked here
against a dense stand-in for flash attention's forward and backward)."""

import pytest
import torch
from torch.testing import assert_close

import hybridflow.models.native.shared_prefix as shared_prefix
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.models.native.model import PackedLayout
from hybridflow.roles.forward import packed_response_logprobs

# three groups, interleaved, one with an empty response, one of a single sample
PROMPTS = [[5, 9, 200, 17], [5, 9, 200, 17], [44, 2], [5, 9, 200, 17], [44, 2], [7]]
RESPONSES = [[3, 4, 5], [6], [8, 9, 10, 11], [12, 13], [], [14, 15]]


def _run(model, share: bool, monkeypatch):
    monkeypatch.setattr(shared_prefix, "has_shared_prompts", lambda prompts: share)
    model.zero_grad()
    logp, entropy = packed_response_logprobs(
        model, PROMPTS, RESPONSES, device=torch.device("cpu"), compute_dtype="float32", with_entropy=True
    )
    (logp * torch.arange(1.0, logp.numel() + 1).view(logp.shape)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return logp.detach(), entropy, grads


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_shared_prompt_packing_equals_separate_sequences(family, monkeypatch):
    model = from_hf_model(tiny_model(family, seed=1)).float()
    separate, shared = _run(model, False, monkeypatch), _run(model, True, monkeypatch)
    assert separate[0].shape == (6, 4) and separate[0][4].abs().sum() == 0  # the empty response
    assert_close(shared[0], separate[0], atol=2e-6, rtol=0)
    assert_close(shared[1], separate[1], atol=2e-6, rtol=0)
    for a, b in zip(shared[2], separate[2]):
        assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_packing_layout():
    p = shared_prefix.pack_shared_prompts(PROMPTS, RESPONSES, torch.device("cpu"))
    # prompts [5 9 200 17], [44 2], [7]; then responses 0, 1, 3 (group 1), 2 (group 2; 4 is empty), 5
    assert p.input_ids.tolist() == [5, 9, 200, 17, 44, 2, 7, 3, 4, 5, 6, 12, 13, 8, 9, 10, 11, 14, 15]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 0, 4, 5, 6, 4, 4, 5, 2, 3, 4, 5, 1, 2]
    assert p.cu_seqlens.tolist() == [0, 4, 6, 7, 10, 11, 13, 17, 19]
    # response 0's tokens are predicted by its prompt's last row, then by its own rows
    assert p.index.tolist() == [3, 7, 8, 3, 5, 13, 14, 15, 3, 11, 6, 17]
    assert p.shared.cu_q.tolist() == [0, 6, 10, 12] and p.shared.cu_k.tolist() == [0, 4, 6, 7]
    assert (p.shared.prompts_end, p.shared.responses_start) == (7, 7)
    assert p.shared.groups == [(0, [3, 4, 5]), (1, [6]), (2, [7])]
    # a group whose only response is empty keeps its prompt after those of the groups with responses
    q = shared_prefix.pack_shared_prompts([[1, 2], [3], [3]], [[], [4], [5, 6]], torch.device("cpu"))
    assert q.input_ids.tolist() == [3, 1, 2, 4, 5, 6] and q.index.tolist() == [0, 0, 4]
    assert (q.shared.prompts_end, q.shared.responses_start) == (1, 3)
    assert q.shared.cu_k.tolist() == [0, 1] and q.shared.groups == [(0, [2, 3]), (1, [])]


def _dense_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """What flash attention's varlen forward returns: output and log-sum-exp [H, N] per segment pair."""
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
    groups = q.shape[1] // k.shape[1]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        s = _scores(q[a:b], k[c:d], scale, causal)  # [H, q, k]
        lse[:, a:b] = torch.logsumexp(s, -1).float()
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[c:d].repeat_interleave(groups, 1))
    return out, lse, None, None


def _dense_flash_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, rng, unused, scale):
    """Flash attention's backward contract: P from the given lse, D = rowsum(dO * out) of the given out."""
    groups, kv_heads = q.shape[1] // k.shape[1], k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        p = torch.exp(_scores(q[a:b], k[c:d], scale, causal) - lse[:, a:b, None].double())  # [H, q, k]
        do = grad_out[a:b]
        kk, vv = (t[c:d].repeat_interleave(groups, 1) for t in (k, v))
        ds = p * (torch.einsum("qhd,khd->hqk", do, vv) - (do * out[a:b]).sum(-1).T[..., None])
        dq[a:b] = torch.einsum("hqk,khd->qhd", ds, kk) * scale
        dk[c:d] = (torch.einsum("hqk,qhd->khd", ds, q[a:b]) * scale).view(d - c, kv_heads, groups, -1).sum(2)
        dv[c:d] = torch.einsum("hqk,qhd->khd", p, do).view(d - c, kv_heads, groups, -1).sum(2)
    return dq, dk, dv


def _scores(q, k, scale, causal):
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(q.shape[1] // k.shape[1], 1)) * scale
    if causal:
        s = s.masked_fill(~torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril(), float("-inf"))
    return s


def test_flash_path_merges_the_two_parts_exactly(monkeypatch):
    """The CUDA path's algebra (log-sum-exp merge forward; each part's backward fed the merged output
    and log-sum-exp) against SDPA per segment, with flash attention replaced by a dense stand-in."""
    monkeypatch.setattr(shared_prefix, "_flash_forward", _dense_flash_forward)
    monkeypatch.setattr(shared_prefix, "_flash_backward", _dense_flash_backward)
    packing = shared_prefix.pack_shared_prompts(PROMPTS, RESPONSES, torch.device("cpu"))
    n, bounds = packing.input_ids.numel(), packing.cu_seqlens.tolist()
    layout = PackedLayout(packing.cu_seqlens, bounds, 4, None, packing.shared)
    torch.manual_seed(0)
    q, k, v = (torch.randn(n, h, 8, dtype=torch.float64, requires_grad=True) for h in (6, 2, 2))
    weights = torch.randn(n, 6, 8, dtype=torch.float64)
    results = []
    for attention in (shared_prefix._FlashSharedPrefix.apply, shared_prefix._reference):
        out = attention(q, k, v, layout)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
        results.append((out, *grads))
    for got, want in zip(*results):
        assert_close(got, want, atol=1e-6, rtol=0)  # the log-sum-exps are float32
