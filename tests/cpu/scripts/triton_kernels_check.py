"""Run under TRITON_INTERPRET=1 (set before triton is imported): the engine's Triton kernels on CPU
tensors against their PyTorch references. Prints one line per check; exits non-zero on a mismatch."""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from hybridflow.engine.attention import paged_decode_attention_reference  # noqa: E402
from hybridflow.engine.sampler import sample_reference, step_keys  # noqa: E402
from hybridflow.engine.triton_copy import cast_copy_triton  # noqa: E402
from hybridflow.engine.triton_decode import paged_decode_attention_triton  # noqa: E402
from hybridflow.engine.triton_sampler import sample_triton  # noqa: E402
from hybridflow.rollout.sampling import SamplingParams  # noqa: E402

torch.manual_seed(0)
failed = False
# (batch, q heads, kv heads, head dim, page, table width, block, programs target): blocks that span
# pages (block > page), pages that span blocks, one split (the output written directly) and several
# (partials merged by the second kernel)
cases = [
    (3, 4, 2, 16, 16, 5, 16, 264),
    (3, 4, 2, 16, 16, 5, 32, 1),
    (2, 6, 2, 32, 16, 3, 16, 264),
    (2, 6, 2, 32, 32, 3, 16, 1),
    (1, 2, 2, 16, 16, 2, 16, 264),
]
for b, hq, hkv, d, page, pages, block, target in cases:
    k, v = torch.randn(12 * page, hkv, d), torch.randn(12 * page, hkv, d)
    q = torch.randn(b, hq, d)
    table = torch.randint(1, 12, (b, pages), dtype=torch.int32)
    ctx = torch.randint(0, pages * page + 1, (b,), dtype=torch.int32)
    ctx[0] = pages * page  # a full table
    ctx[-1] = 0 if b > 1 else ctx[-1]  # a padded row: no context, zeros out
    got = paged_decode_attention_triton(q, k, v, table, ctx, page, block=block, programs_target=target)
    err = (got - paged_decode_attention_reference(q, k, v, table, ctx, page)).abs().max().item()
    print(f"decode attention b={b} hq={hq} hkv={hkv} d={d} page={page} block={block} ctx={ctx.tolist()}: "
          f"max abs err {err:.2e}")  # fmt: skip
    failed |= err > 1e-5
logits = torch.randn(6, 1000) * 3
logits[5, 500:] = logits[5, :500]  # exact ties across slices: the first index wins, as in torch.argmax
seeds, steps = torch.arange(6) * 77 + 1, torch.arange(6)
# (block, programs target): a row in one program; in slices of 128 (the last one short) merged
for (block, target), t in [((1024, 1), t) for t in (0.0, 0.7, 1.0)] + [
    ((64, 48), t) for t in (0.0, 0.7, 1.0)
]:
    ref = sample_reference(logits, SamplingParams(temperature=t), seeds, steps)
    got = sample_triton(logits, t, step_keys(seeds, steps), block=block, programs_target=target)
    err = max((ref[1] - got[1]).abs().max().item(), (ref[2] - got[2]).abs().max().item())
    same = torch.equal(ref[0], got[0])
    print(f"sampler temperature={t} block={block} programs={target}: same tokens {same}, "
          f"log-prob max abs err {err:.2e}")  # fmt: skip
    failed |= not same or err > 1e-5
# the LM head's softmax work: stats in one sweep (a vocabulary of 2.5 blocks), gradient in place
from hybridflow.models.native import triton_logprobs  # noqa: E402
from hybridflow.models.native.logprobs import _chunk_grad, _chunk_stats  # noqa: E402

triton_logprobs.BLOCK = 64
head_logits = (torch.randn(5, 160) * 4).bfloat16()
head_targets = torch.tensor([0, 159, 63, 64, 7])
upstream = torch.randn(5)
for scale in (1.0, 1 / 0.7):
    ref = _chunk_stats(head_logits, head_targets, scale)
    got = triton_logprobs.chunk_stats(head_logits, head_targets, scale)
    err = max((r - g).abs().max().item() for r, g in zip(ref, got))
    d_ref = _chunk_grad(head_logits, head_targets, upstream, ref[2], scale).float()
    d_got = triton_logprobs.chunk_grad_(head_logits.clone(), head_targets, upstream, got[2], scale).float()
    d_err = (d_ref - d_got).abs().max().item()
    print(f"log-prob head scale={scale:.3f}: stats error {err:.2e}, gradient error {d_err:.2e}")
    failed |= err > 5e-5 or d_err > 1e-2 * d_ref.abs().max().item()  # fp32 sums of ~20; bf16 out
# many tensors of mixed sizes (fp32 -> bf16 and fp32 -> fp32) copied by one launch per dtype pair
sources = [torch.randn(n) for n in (1, 5, 1000, 37, 4096, 3)] + [torch.randn(7, 9)]
targets = [
    torch.zeros(s.shape, dtype=torch.bfloat16 if i % 2 else torch.float32) for i, s in enumerate(sources)
]
cast_copy_triton(targets, sources, block=64, iters=4)
# the interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even): allow one bf16 step
same = all(
    torch.allclose(t.float(), s, rtol=2**-7, atol=0) if t.dtype == torch.bfloat16 else torch.equal(t, s)
    for t, s in zip(targets, sources, strict=True)
)
print(f"cast copy of {len(sources)} tensors: every element in place {same}")
failed |= not same
sys.exit(1 if failed else 0)
