"""On CUDA: the prefix-cache prefill (new tokens attend to the cached prefix through varlen flash
attention, causal aligned at the bottom right) against SDPA with an explicit mask, and greedy turns
of an engine with and without the prefix cache.

    PYTHONPATH=. python bench/prefix_attention_check.py
"""

from __future__ import annotations

import json
import random
import sys

import torch
import torch.nn.functional as F

from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.attention import prefix_prefill_attention
from hybridflow.rollout.sampling import SamplingParams

sys.path.insert(0, "bench")
from rollout import random_model  # noqa: E402


def attention_error() -> float:
    torch.manual_seed(0)
    q_lens, k_lens = [5, 64, 1, 130], [70, 64, 200, 300]
    hq, hkv, d = 12, 2, 128
    q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(k_lens), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qb, kb = [0], [0]
    for a, b in zip(q_lens, k_lens):
        qb.append(qb[-1] + a)
        kb.append(kb[-1] + b)
    cu = (
        torch.tensor(qb, dtype=torch.int32, device="cuda"),
        torch.tensor(kb, dtype=torch.int32, device="cuda"),
    )
    got = prefix_prefill_attention(q, k, v, qb, kb, cu).float()
    worst = 0.0
    for i, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        qs = q[qb[i] : qb[i + 1]].float().transpose(0, 1)[None]
        ks = k[kb[i] : kb[i + 1]].float().transpose(0, 1)[None]
        vs = v[kb[i] : kb[i + 1]].float().transpose(0, 1)[None]
        mask = torch.arange(nk, device="cuda")[None, :] <= torch.arange(nk - nq, nk, device="cuda")[:, None]
        ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
        worst = max(worst, (got[qb[i] : qb[i + 1]] - ref).abs().max().item())
    return worst


def first_differences(xs, ys) -> list[int]:
    """Where each pair of replies first differs (its length when identical), sorted."""
    return sorted(next((k for k, (p, q) in enumerate(zip(a, b)) if p != q), len(a)) for a, b in zip(xs, ys))


def greedy_turns(dtype) -> dict:
    """Turn 2 of 32 conversations, greedy: with the cache (turn 1 cached) against without, and, as the
    floor of rounding noise, without the cache against itself on the same prompts in another batch
    order (decode kernels see other batch shapes)."""
    model = random_model("1.5b", torch.device("cuda"), dtype)
    rng = random.Random(0)
    convs = [[rng.randrange(151000) for _ in range(300 + 7 * i)] for i in range(32)]
    users = [[rng.randrange(151000) for _ in range(20)] for _ in convs]
    params = SamplingParams(max_tokens=64, temperature=0)

    def engine(cache: bool) -> Engine:
        config = EngineConfig(max_context_tokens=1024, prefix_cache=cache, compute_dtype=str(dtype)[6:])
        return Engine(model, eos_token_ids=[], config=config)

    plain = engine(False)
    first = [g.token_ids for g in plain.generate(convs, params)]
    turn2 = [c + r + u for c, r, u in zip(convs, first, users)]
    want = [g.token_ids for g in plain.generate(turn2, params)]
    cached = engine(True)
    assert [g.token_ids for g in cached.generate(convs, params)] == first
    got = [g.token_ids for g in cached.generate(turn2, params)]
    reordered = [g.token_ids for g in engine(False).generate(turn2[::-1], params)][::-1]
    # a prefix whose K/V came from a prefill (the prompt of turn 1, extended without the reply)
    extended = [c + u for c, u in zip(convs, users)]
    want_ext = [g.token_ids for g in plain.generate(extended, params)]
    got_ext = [g.token_ids for g in cached.generate(extended, params)]
    return {
        "prompt_extended_identical_of_32_with_cache": sum(a == b for a, b in zip(got_ext, want_ext)),
        "prompt_extended_first_difference_with_cache": first_differences(got_ext, want_ext),
        "turn2_identical_of_32_with_cache": sum(a == b for a, b in zip(got, want)),
        "turn2_first_difference_with_cache": first_differences(got, want),
        "turn2_identical_of_32_no_cache_other_batch_order": sum(a == b for a, b in zip(reordered, want)),
        "turn2_first_difference_no_cache_other_batch_order": first_differences(reordered, want),
        "stats_with_cache": cached.prefix_cache_stats(),
    }


if __name__ == "__main__":
    print(json.dumps({"attention_max_abs_error_vs_sdpa_fp32": attention_error()}))
    for dtype in (torch.bfloat16,):  # fp32 on CUDA: flash attention takes half precision only
        print(json.dumps({"dtype": str(dtype), **greedy_turns(dtype)}), flush=True)
