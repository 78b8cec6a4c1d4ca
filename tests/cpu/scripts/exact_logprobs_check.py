"""Run under TRITON_INTERPRET=1: rollout.exact_logprobs end to end on tiny models (the batch-invariant
kernels on CPU tensors). The engine samples; the trainer's packed forward over the same tokens gives
the same log-probs to the bit, in float32 and under bfloat16 autocast, for a prompt alone or in a
batch, after a prefix-cache hit and from a decode graph's batch padding; the ordinary trainer forward
does not (the check can fail). Prints one line per case; exits non-zero on a mismatch."""

import os
import sys
from dataclasses import replace

assert os.environ.get("TRITON_INTERPRET") == "1"

import torch  # noqa: E402

from hybridflow.engine import Engine, EngineConfig  # noqa: E402
from hybridflow.engine.drafter import SpeculativeConfig  # noqa: E402
from hybridflow.models import tiny_model  # noqa: E402
from hybridflow.models.native import from_hf_model  # noqa: E402
from hybridflow.roles.forward import packed_response_logprobs, shares_prompts  # noqa: E402
from hybridflow.rollout.sampling import SamplingParams  # noqa: E402

# lengths that straddle the interpreter's tiles (16 rows, key blocks of 16, key chunks of 32)
PROMPTS = [[5, 9, 200, 17, 3, 8], list(range(30, 66)), [250]]
TEMPERATURE = 0.7
failed = False


def check(name: str, ok: bool, detail: str = "") -> None:
    global failed
    print(f"{name}: {'ok' if ok else 'MISMATCH'} {detail}")
    failed |= not ok


def trainer_logprobs(model, prompts, outs, dtype: str) -> list[torch.Tensor]:
    logp, _ = packed_response_logprobs(
        model, prompts, [o.token_ids for o in outs], device=torch.device("cpu"), compute_dtype=dtype,
        temperature=TEMPERATURE,
    )  # fmt: skip
    return [row[: len(o.token_ids)] for row, o in zip(logp, outs)]


def same_bits(outs, logps) -> tuple[bool, float]:
    gap = 0.0
    ok = True
    for o, row in zip(outs, logps):
        rollout = torch.tensor(o.logprobs, dtype=torch.float64).float()  # the engine's float32 values
        ok &= torch.equal(rollout, row)
        gap = max(gap, (rollout - row).abs().max().item())
    return ok, gap


for family, dtype, own_copy in (("qwen2", "float32", True), ("llama", "bfloat16", False)):
    hf = tiny_model(family, seed=3)
    model = from_hf_model(hf)
    plain = from_hf_model(hf)  # the ordinary kernels, for the contrast
    config = EngineConfig(page_size=4, max_context_tokens=96, decode_steps=4, compute_dtype=dtype,
                          share_weights=not own_copy, exact_logprobs=True)  # fmt: skip
    engine = Engine(model, eos_token_ids=[1], config=config)
    model.use_exact_kernels()  # the trainer's side (a shared module: the engine's call made it so)
    params = SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=10, seed=5)
    outs = engine.generate(PROMPTS, params)
    prompts = [p for p in PROMPTS for _ in range(params.n)]
    ok, gap = same_bits(outs, trainer_logprobs(model, prompts, outs, dtype))
    tokens = sum(len(o.token_ids) for o in outs)
    check(f"{family} {dtype}: engine and trainer log-probs", ok, f"({tokens} tokens, max gap {gap:.1e})")
    # the contrast: the ordinary trainer forward is close, not equal
    ok, gap = same_bits(outs, trainer_logprobs(plain, prompts, outs, dtype))
    check(f"{family} {dtype}: the ordinary kernels differ", not ok and gap < 0.05, f"(max gap {gap:.1e})")
    if not own_copy:  # (the batch and cache cases once: the engine's own copy, fused projections)
        continue
    # a prompt alone (a batch of one, its own graph bucket) gives the batch's bits
    alone = engine.generate([PROMPTS[1]], replace(params, first_sequence=params.n))  # its seeds
    check(
        f"{family} {dtype}: alone as in the batch",
        [o.logprobs for o in alone] == [o.logprobs for o in outs[2:4]],
    )
    # the same prompts again: prefilled from the prefix cache's pages
    before = engine.prefix_cache_stats()["cached_tokens"]
    again = engine.generate(PROMPTS, params)
    hit = engine.prefix_cache_stats()["cached_tokens"] > before
    same = [o.logprobs for o in again] == [o.logprobs for o in outs]
    check(f"{family} {dtype}: from the prefix cache", hit and same, f"(hit {hit})")
    # speculative decoding (drafts from the samples in flight, then from the first call's responses):
    # a verified position's logits are a decode step's to the bit, so tokens and log-probs are too
    spec = Engine(
        model,
        eos_token_ids=[1],
        config=replace(config, speculative=SpeculativeConfig(3, max_batch_sequences=16, adaptive=False)),
    )
    calls = [spec.generate(PROMPTS, params) for _ in range(2)]
    check(
        f"{family} {dtype}: speculative, the plain engine's bits",
        all(
            [(o.token_ids, o.logprobs) for o in c] == [(o.token_ids, o.logprobs) for o in outs] for c in calls
        )
        and spec.speculation.counts["accepted"] > 0,
        f"({spec.speculation.counts})",
    )

# a vocabulary wider than the device sampler's slices (2,048 entries a program): its own log-softmax
# sums in another order than the trainer's kernel, whose values the decode step's record carries
wide = from_hf_model(tiny_model("qwen2", seed=3, vocab_size=5000))
config = EngineConfig(
    page_size=4, max_context_tokens=96, decode_steps=4, exact_logprobs=True, share_weights=False
)
outs = Engine(wide, eos_token_ids=[1], config=config).generate(PROMPTS, params)
wide.use_exact_kernels()
ok, gap = same_bits(
    outs, trainer_logprobs(wide, [p for p in PROMPTS for _ in range(params.n)], outs, "float32")
)
check("qwen2 float32, 5,000-entry vocabulary: engine and trainer log-probs", ok, f"(max gap {gap:.1e})")

# the update's forward: the exact kernels' gradients are the ordinary model's (float32: to rounding),
# with each prompt packed once for its responses (kernels.shared_attention) and as separate sequences
hf = tiny_model("qwen2", seed=7)
for label, prompts, responses in (
    ("separate", PROMPTS, [[7, 8, 9, 10], list(range(40, 61)), [3, 4]]),
    ("shared prompts", [PROMPTS[1]] * 3 + [PROMPTS[0]] * 2, [[7, 8], list(range(40, 61)), [], [3], [9] * 19]),
):
    exact, plain = from_hf_model(hf), from_hf_model(hf)
    exact.use_exact_kernels()
    if label == "shared prompts":  # (the exact trainer packs each prompt once, as the ordinary one does)
        check("the exact trainer packs a prompt once for its responses", shares_prompts(exact))
    for m in (exact, plain):
        logp, _ = packed_response_logprobs(
            m, prompts, responses, device=torch.device("cpu"), compute_dtype="float32"
        )
        logp.sum().backward()
    worst = max(
        ((a.grad - b.grad).norm() / b.grad.norm()).item()
        for (name, a), b in zip(exact.named_parameters(), plain.parameters())
    )
    check(
        f"gradients through the exact kernels, {label}",
        worst < 1e-5,
        f"(worst relative error over parameters {worst:.1e})",
    )

# the shared-prefix packing's exact attention (prompts packed once, kernels.shared_attention) against
# the same rows as separate sequences: the forward's bits, gradients to float32 rounding (the copies'
# dK / dV summed in another order), and a backward that repeats to the bit
from hybridflow.kernels.packed_attention import exact_packed_attention, packed_pages  # noqa: E402
from hybridflow.kernels.shared_attention import shared_pages  # noqa: E402
from hybridflow.models.native.shared_prefix import pack_shared_prompts  # noqa: E402

torch.manual_seed(2)
prompts = [list(range(20))] * 3 + [[5] * 37] * 2 + [[9, 8], [1] * 3]
responses = [[1] * 5, [2] * 40, [3] * 17, [4] * 2, [], [6] * 30, []]
packing = pack_shared_prompts(prompts, responses, torch.device("cpu"))
bounds = packing.cu_seqlens.tolist()
separate_rows, separate_bounds = [], [0]
for prompt, members in packing.shared.groups:
    prompt_rows = list(range(bounds[prompt], bounds[prompt + 1]))
    for rows in [prompt_rows + list(range(bounds[r], bounds[r + 1])) for r in members] or [prompt_rows]:
        separate_rows += rows
        separate_bounds.append(len(separate_rows))
first_copy = torch.tensor([separate_rows.index(row) for row in range(bounds[-1])])
q, k, v, g = (torch.randn(bounds[-1], h, 16) for h in (4, 2, 2, 4))
leaves = [t.clone().requires_grad_() for t in (q, k, v)]
pages = shared_pages(bounds, packing.shared.groups, 2, "cpu")
shared_out = exact_packed_attention(*leaves, pages)
ours = torch.autograd.grad(shared_out, leaves, g)
again = torch.autograd.grad(exact_packed_attention(*leaves, pages), leaves, g)
index = torch.tensor(separate_rows)
separate_out = exact_packed_attention(*(t[index] for t in leaves), packed_pages(separate_bounds, 2, "cpu"))
theirs = torch.autograd.grad(separate_out[first_copy], leaves, g)
errors = [((a - b).norm() / b.norm()).item() for a, b in zip(ours, theirs)]
check(
    "shared-prefix exact attention",
    torch.equal(shared_out, separate_out[first_copy])
    and all(e < 1e-5 for e in errors)
    and all(torch.equal(a, b) for a, b in zip(ours, again)),
    f"(forward bits equal; dq/dk/dv relative error {', '.join(f'{e:.1e}' for e in errors)})",
)


# the packed attention's own backward in bfloat16, uneven sequences and 2 query heads a KV head:
# its error against float64 is of the order of PyTorch's bfloat16 attention's

torch.manual_seed(0)
bounds = [0, 5, 40, 41, 90]
q, k, v, g = (torch.randn(90, h, 16) for h in (4, 2, 2, 4))


def reference_grads(dtype):
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in inputs)  # [1, H, L, D]
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.autograd.grad(torch.cat(outs), inputs, g.to(dtype))


inputs = [t.bfloat16().requires_grad_() for t in (q, k, v)]
ours = torch.autograd.grad(
    exact_packed_attention(*inputs, packed_pages(bounds, 2, "cpu")), inputs, g.bfloat16()
)
truth, torch_bf16 = reference_grads(torch.float64), reference_grads(torch.bfloat16)
errors = [((a.double() - t).norm() / t.norm()).item() for a, t in zip(ours, truth)]
torch_errors = [((a.double() - t).norm() / t.norm()).item() for a, t in zip(torch_bf16, truth)]
check(
    "packed attention backward, bfloat16",
    all(e < 2 * te + 1e-3 for e, te in zip(errors, torch_errors)),
    f"(dq/dk/dv relative error {', '.join(f'{e:.1e}' for e in errors)}; PyTorch's bfloat16 "
    f"{', '.join(f'{e:.1e}' for e in torch_errors)})",
)

# the exact layer's fused pieces against their PyTorch forms: the residual add + norm (the sum's bits,
# and the norm's bits of that sum as the standalone kernel gives them, out in the matmul's dtype) and
# SwiGLU; each row alone as in the batch; gradients (fused kernels of their own) against the PyTorch
# forms' and float64. (The interpreter's casts to bfloat16 truncate where CUDA's and torch's round to
# nearest: 2 units in the last place allowed.)
from hybridflow.kernels.rms_norm import exact_add_rms_norm, exact_rms_norm, reference_rms_norm  # noqa: E402
from hybridflow.kernels.swiglu import exact_silu_mul  # noqa: E402

torch.manual_seed(1)
x, o, w = torch.randn(37, 48), torch.randn(37, 48).bfloat16(), torch.rand(48) + 0.5
total, h = exact_add_rms_norm(x, o, w, 1e-6, torch.bfloat16)
alone = exact_add_rms_norm(x[5:6], o[5:6], w, 1e-6, torch.bfloat16)[1]
check(
    "residual add + norm",
    torch.equal(total, x + o)
    and h.dtype == torch.bfloat16
    and torch.equal(h, exact_rms_norm(x + o, w, 1e-6, torch.bfloat16))
    and torch.equal(alone, h[5:6])
    and ((h.float() - (want := reference_rms_norm(x + o, w, 1e-6))).abs() / want.abs()).max().item()
    < 2 * 2**-7,
)
leaves = [t.clone().requires_grad_() for t in (x, o.float(), w)]
g_total, g_h = torch.randn(37, 48), torch.randn(37, 48).bfloat16()
ours = torch.autograd.grad(exact_add_rms_norm(*leaves, 1e-6, torch.bfloat16), leaves, (g_total, g_h))
theirs_total = leaves[0] + leaves[1]
theirs = torch.autograd.grad(
    (theirs_total, reference_rms_norm(theirs_total, leaves[2], 1e-6).bfloat16()), leaves, (g_total, g_h)
)
again = torch.autograd.grad(exact_add_rms_norm(*leaves, 1e-6, torch.bfloat16), leaves, (g_total, g_h))
check(
    "residual add + norm, gradients",  # (one launch: the PyTorch formulas' to rounding, repeating)
    all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(ours, theirs))
    and all(torch.equal(a, b) for a, b in zip(ours, again)),
)


def relative_error(a: torch.Tensor, truth: torch.Tensor) -> float:
    return ((a.double() - truth).norm() / truth.norm()).item()


# a bfloat16 norm (130 rows: the backward's programs of 16 rows, the last one partial): gradients
# against float64 truth, within 3x PyTorch's own bfloat16 backward's error (the interpreter truncates
# each of the two bfloat16 roundings on the way, where PyTorch rounds to nearest: ~2-2.5x measured)
x_norm = torch.randn(130, 96).bfloat16()
w_norm, g_norm = torch.rand(96) + 0.5, torch.randn(130, 96).bfloat16()
leaves = [x_norm.clone().requires_grad_(), w_norm.clone().requires_grad_()]
ours = torch.autograd.grad(exact_rms_norm(*leaves, 1e-6, torch.bfloat16), leaves, g_norm)
torch_bf16 = torch.autograd.grad(reference_rms_norm(*leaves, 1e-6).bfloat16(), leaves, g_norm)
exact_leaves = [x_norm.double().requires_grad_(), w_norm.double().requires_grad_()]
truth = torch.autograd.grad(reference_rms_norm(*exact_leaves, 1e-6), exact_leaves, g_norm.double())
errors = [relative_error(a, t) for a, t in zip(ours, truth)]
torch_errors = [relative_error(a, t) for a, t in zip(torch_bf16, truth)]
check(
    "norm backward, bfloat16",
    [g.dtype for g in ours] == [torch.bfloat16, torch.float32]
    and all(e < 3 * te + 1e-4 for e, te in zip(errors, torch_errors)),
    f"(dx/dw relative error {errors[0]:.1e} / {errors[1]:.1e}; PyTorch's {torch_errors[0]:.1e} / {torch_errors[1]:.1e})",
)
for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 2 * 2**-7)):
    gate, up = torch.randn(37, 3000).to(dtype), torch.randn(37, 3000).to(dtype)
    act = exact_silu_mul(gate, up)
    want = torch.nn.functional.silu(gate) * up
    upstream = torch.randn(37, 3000).to(dtype)
    leaves = [gate.clone().requires_grad_(), up.clone().requires_grad_()]
    grads = torch.autograd.grad(exact_silu_mul(*leaves), leaves, upstream)
    torch_grads = torch.autograd.grad(torch.nn.functional.silu(leaves[0]) * leaves[1], leaves, upstream)
    exact_leaves = [gate.double().requires_grad_(), up.double().requires_grad_()]
    truth = torch.autograd.grad(
        torch.nn.functional.silu(exact_leaves[0]) * exact_leaves[1], exact_leaves, upstream.double()
    )
    errors = [relative_error(a, t) for a, t in zip(grads, truth)]
    torch_errors = [relative_error(a, t) for a, t in zip(torch_grads, truth)]
    check(
        f"SwiGLU {dtype}",
        act.dtype == dtype
        and torch.equal(exact_silu_mul(gate[9:10], up[9:10]), act[9:10])
        and ((act.float() - want.float()).abs() / (want.float().abs() + 1e-3)).max().item() < tolerance
        and all(g.dtype == dtype for g in grads)
        and all(e < 3 * te + 1e-6 for e, te in zip(errors, torch_errors)),  # (as the norm's)
        f"(d gate / d up relative error {errors[0]:.1e} / {errors[1]:.1e}; "
        f"PyTorch's {torch_errors[0]:.1e} / {torch_errors[1]:.1e})",
    )

# rotary of q and k in one launch: each the bits of the one-tensor kernel, gradients (the kernel rotating
# back) the PyTorch form's bits
from hybridflow.kernels.rope import exact_rope_qk, reference_rope, rope  # noqa: E402

q, k = torch.randn(37, 4, 16), torch.randn(37, 2, 16)
cos, sin = torch.randn(37, 16), torch.randn(37, 16)
q_rot, k_rot = exact_rope_qk(q, k, cos, sin, torch.bfloat16)
leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
grads = torch.autograd.grad(exact_rope_qk(*leaves, cos, sin, torch.float32), leaves, (q, k))
want = torch.autograd.grad((reference_rope(leaves[0], cos, sin, torch.float32),
                            reference_rope(leaves[1], cos, sin, torch.float32)), leaves, (q, k))  # fmt: skip
check(
    "rotary of q and k in one launch",
    torch.equal(q_rot, rope(q, cos, sin, torch.bfloat16))
    and torch.equal(k_rot, rope(k, cos, sin, torch.bfloat16))
    and torch.equal(rope(q[3:4], cos[3:4], sin[3:4], torch.float32), rope(q, cos, sin, torch.float32)[3:4])
    and torch.equal(rope(q, cos, sin, torch.float32), reference_rope(q, cos, sin, torch.float32))
    and all(torch.equal(a, b) for a, b in zip(grads, want)),
)
# and with the engine's K/V store in the same launch: each token's rotated k and its v in its slot's
# row of the cache layer (a v that is a column view of a wider projection, as the engine's), nothing
# else of the cache written
for dtype in (torch.float32, torch.bfloat16):
    qkv = torch.randn(37, (4 + 2 + 2) * 16)
    q, k, v = (t.view(37, -1, 16) for t in qkv.to(dtype).split([64, 32, 32], dim=1))
    k_cache, v_cache = torch.full((50, 2, 16), 7.0, dtype=dtype), torch.full((50, 2, 16), 7.0, dtype=dtype)
    slots = torch.randperm(50)[:37]
    with torch.no_grad():
        q_stored, nothing = exact_rope_qk(q, k, cos, sin, dtype, (k_cache, v_cache, slots, v))
    others = torch.ones(50, dtype=torch.bool)
    others[slots] = False
    check(
        f"rotary with the K/V store, {dtype}",
        nothing is None
        and torch.equal(q_stored, rope(q, cos, sin, dtype))
        and torch.equal(k_cache[slots], rope(k, cos, sin, dtype))
        and torch.equal(v_cache[slots], v)
        and bool((k_cache[others] == 7).all() and (v_cache[others] == 7).all()),
    )

# the batch-invariant matmul's forms: the chunks looped in one program or each in a program of its
# own (partials added in order after), loads through pointers (<= 64 rows) or TMA descriptors: every
# row the bits it has alone, whichever form the rows' count picks; near float64's result
from hybridflow.kernels.linear import K_CHUNK, linear  # noqa: E402

for dtype in (torch.float32, torch.bfloat16):
    x, w, b = torch.randn(100, 3 * K_CHUNK + 8), torch.randn(40, 3 * K_CHUNK + 8) * 0.1, torch.randn(40)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    forms = {f"{rows} rows, split {split}": linear(x[:rows], w, b, split=split)
             for rows in (100, 7) for split in (True, False)}  # fmt: skip
    alone = [linear(x[i : i + 1], w, b) for i in (0, 6, 99)]
    truth = x.double() @ w.double().T + b.double()
    check(
        f"matmul forms, {dtype}",
        all(torch.equal(y, forms["100 rows, split False"][: len(y)]) for y in forms.values())
        and all(torch.equal(y, forms["100 rows, split False"][i : i + 1]) for y, i in zip(alone, (0, 6, 99)))
        and relative_error(forms["100 rows, split True"], truth) < (1e-6 if dtype == torch.float32 else 1e-2),
        f"(relative error {relative_error(forms['100 rows, split True'], truth):.1e})",
    )

# the residual add in the matmul's epilogue (the MLP's down projection): torch's `residual + matmul` to
# the bit in every form, the product rounded to its own dtype first (a float32 residual stream over
# bfloat16 matmuls, as autocast runs the master weights); its gradients those of the separate add.
# (A bfloat16 residual is left to the GPU: the interpreter rounds float32 -> bfloat16 toward zero, torch
# to nearest)
from hybridflow.kernels.linear import exact_linear  # noqa: E402

for dtype in (torch.float32, torch.bfloat16):
    x, w, b = torch.randn(100, 3 * K_CHUNK + 8), torch.randn(40, 3 * K_CHUNK + 8) * 0.1, torch.randn(40)
    x, w, b = x.to(dtype), w.to(dtype), b.to(dtype)
    stream = torch.randn(100, 40)
    same = all(
        torch.equal(linear(x[:rows], w, b, split=split, residual=stream[:rows]), stream[:rows] + linear(x[:rows], w, b))
        for rows in (100, 7) for split in (True, False)
    )  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (x.float(), w.float(), stream)]
    fused = exact_linear(leaves[0].to(dtype), leaves[1].to(dtype), None, leaves[2])
    upstream = torch.randn_like(fused)
    grads = torch.autograd.grad(fused, leaves, upstream)
    separate = leaves[2] + exact_linear(leaves[0].to(dtype), leaves[1].to(dtype), None)
    want = torch.autograd.grad(separate, leaves, upstream)
    check(
        f"matmul with the residual add in its epilogue, {dtype}",
        same and torch.equal(fused, separate) and all(torch.equal(g, h) for g, h in zip(grads, want)),
    )
sys.exit(1 if failed else 0)
