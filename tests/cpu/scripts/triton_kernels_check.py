"""Run under TRITON_INTERPRET=1 (set before triton is imported): the engine's Triton kernels on CPU
tensors against their PyTorch references. Prints one line per check; exits non-zero on a mismatch."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from hybridflow.engine.attention import paged_decode_attention_reference  # noqa: E402
from hybridflow.engine.sampler import sample_reference, step_keys  # noqa: E402
from hybridflow.engine.triton_decode import paged_decode_attention_triton  # noqa: E402
from hybridflow.engine.triton_sampler import sample_triton  # noqa: E402
from hybridflow.rollout.sampling import SamplingParams  # noqa: E402

torch.manual_seed(0)
failed = False
for b, hq, hkv, d, page, pages in [(3, 4, 2, 16, 16, 5), (2, 6, 2, 32, 16, 3), (1, 2, 2, 16, 16, 2)]:
    k, v = torch.randn(12 * page, hkv, d), torch.randn(12 * page, hkv, d)
    q = torch.randn(b, hq, d)
    table = torch.randint(1, 12, (b, pages), dtype=torch.int32)
    ctx = torch.randint(0, pages * page + 1, (b,), dtype=torch.int32)
    ctx[0] = pages * page  # a full table
    ctx[-1] = 0 if b > 1 else ctx[-1]  # a padded row: no context, zeros out
    err = (
        (
            paged_decode_attention_triton(q, k, v, table, ctx, page)
            - paged_decode_attention_reference(q, k, v, table, ctx, page)
        )
        .abs()
        .max()
        .item()
    )
    print(f"decode attention b={b} hq={hq} hkv={hkv} d={d} ctx={ctx.tolist()}: max abs err {err:.2e}")
    failed |= err > 1e-5
logits = torch.randn(6, 1000) * 3
seeds, steps = torch.arange(6) * 77 + 1, torch.arange(6)
for t in (0.0, 0.7, 1.0):
    ref = sample_reference(logits, SamplingParams(temperature=t), seeds, steps)
    got = sample_triton(logits, t, step_keys(seeds, steps))
    err = max((ref[1] - got[1]).abs().max().item(), (ref[2] - got[2]).abs().max().item())
    same = torch.equal(ref[0], got[0])
    print(f"sampler temperature={t}: same tokens {same}, log-prob max abs err {err:.2e}")
    failed |= not same or err > 1e-5
sys.exit(1 if failed else 0)
