"""The rollout engine against transformers' generate and the trainer's log-probs; paging, sharing,
preemption, stops, reproducible sampling and its distribution."""

from dataclasses import replace

import pytest
import torch
from interpreter import in_triton_interpreter
from torch.testing import assert_close

from hybridflow.batch import TrainingBatch, pad_ragged
from hybridflow.config.schema import ActorConfig
from hybridflow.engine import Engine, EngineConfig
from hybridflow.engine.kv_cache import KVCache, pool_pages
from hybridflow.engine.sampler import sample_reference
from hybridflow.engine.scheduler import Scheduler
from hybridflow.engine.sequence import PrefillJob, Sequence
from hybridflow.errors import UserError
from hybridflow.models import tiny_model
from hybridflow.models.native import from_hf_model, sequence_log_probs
from hybridflow.models.tiny import FAMILIES
from hybridflow.roles.actor import Actor
from hybridflow.rollout.hf import HFBackend
from hybridflow.rollout.sampling import SamplingParams

PROMPTS = [[5, 9, 200, 17, 3, 8], [44, 2, 2], list(range(30, 60)), [250]]


def _engine(model, eos=(1,), **config) -> Engine:
    return Engine(model, eos_token_ids=list(eos), config=EngineConfig(**({"page_size": 4} | config)))


def _reference(hf, params, eos=(1,)):
    return HFBackend(hf, pad_token_id=0, eos_token_ids=list(eos)).generate(PROMPTS, params)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_generate(family):
    hf = tiny_model(family, seed=1)
    params = SamplingParams(n=2, temperature=0, max_tokens=24)
    ref = _reference(hf, params)
    # a stop token that greedy decoding of the first prompt actually reaches, at step 5
    stop = ref[0].token_ids[5]
    params.stop_token_ids = [stop]
    ref = _reference(hf, params)
    engine = _engine(from_hf_model(hf), max_context_tokens=128)
    out = engine.generate(PROMPTS, params)
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]
    assert [g.finish_reason for g in out] == [g.finish_reason for g in ref]
    assert out[0].finish_reason == "stop" and out[0].token_ids[-1] == stop
    for a, b in zip(out, ref):
        assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_preemption_by_recompute_changes_nothing():
    hf = tiny_model("llama", seed=2)
    model = from_hf_model(hf)
    roomy = _engine(model, max_context_tokens=64)
    tight = _engine(model, max_context_tokens=64, kv_cache_tokens=80)  # 20 pages of 4 for 8 sequences
    for params in (
        SamplingParams(n=2, temperature=0, max_tokens=24),
        SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=24, seed=11),
    ):
        a, b = roomy.generate(PROMPTS, params), tight.generate(PROMPTS, params)
        assert tight.stats["preemptions"] > 0 and roomy.stats["preemptions"] == 0
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        assert_close(torch.tensor(a[5].logprobs), torch.tensor(b[5].logprobs), atol=1e-5, rtol=0)


def test_runs_of_decode_steps_change_nothing():
    """The device runs several decode steps per look of the host: tokens, log-probs and finish
    reasons equal one step per look, with stops inside a run, the context limit and a tight pool."""
    model = from_hf_model(tiny_model("qwen2", seed=3))
    stops = list(range(3, model.config.vocab_size, 40))  # ~1/40 a step: most sequences stop mid-run
    params = SamplingParams(n=3, temperature=1.0, max_tokens=29, stop_token_ids=stops, seed=4)
    one = _engine(model, max_context_tokens=48, decode_steps=1)
    ref = one.generate(PROMPTS, params)
    reasons = {g.finish_reason for g in ref}
    assert reasons == {"stop", "length"} and 29 in {len(g.token_ids) for g in ref}
    runs = {}
    for config in ({"decode_steps": 8}, {"decode_steps": 5, "kv_cache_tokens": 96}):
        engine = _engine(model, max_context_tokens=48, **config)
        out = engine.generate(PROMPTS, params)
        assert [g.token_ids for g in out] == [g.token_ids for g in ref]
        assert [g.finish_reason for g in out] == [g.finish_reason for g in ref]
        for a, b in zip(out, ref):
            assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
            assert_close(
                torch.tensor(a.unscaled_logprobs), torch.tensor(b.unscaled_logprobs), atol=1e-5, rtol=0
            )
        runs[config["decode_steps"]] = engine.stats
    assert runs[8]["steps"] == 5 and one.stats["steps"] == 29  # a prefill, then runs of up to 8 steps
    assert runs[5]["preemptions"] > 0


def test_compiled_layers_generate_what_eager_layers_do():
    model = from_hf_model(tiny_model("qwen2", seed=9))
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=3)
    eager = _engine(model, max_context_tokens=64).generate(PROMPTS, params)
    compiled = _engine(model, max_context_tokens=64, compile_layers=True).generate(PROMPTS, params)
    assert [g.token_ids for g in compiled] == [g.token_ids for g in eager]
    for a, b in zip(compiled, eager):
        assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_seeded_sampling_is_reproducible_and_samples_differ():
    model = from_hf_model(tiny_model("qwen2", seed=3))
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=5)
    a = _engine(model, max_context_tokens=64).generate(PROMPTS, params)
    b = _engine(model, max_context_tokens=64, max_batch_sequences=3).generate(PROMPTS, params)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]  # whatever shares the batch
    assert len({tuple(g.token_ids) for g in a[:4]}) > 1  # the n samples of a prompt differ
    other = _engine(model, max_context_tokens=64).generate(
        PROMPTS, SamplingParams(n=4, max_tokens=16, seed=6)
    )
    assert [g.token_ids for g in a] != [g.token_ids for g in other]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_equal_the_trainers(temperature):
    """Rollout log-probs of sampled tokens = the trainer's log-probs of the same sequences (fp32)."""
    model = from_hf_model(tiny_model("qwen3", seed=4))
    params = SamplingParams(n=3, temperature=temperature, max_tokens=20, seed=1)
    out = _engine(model, max_context_tokens=64).generate(PROMPTS, params)
    with torch.no_grad():
        trainer = sequence_log_probs(model, [PROMPTS[g.prompt_index] + g.token_ids for g in out])
    for g, lp in zip(out, trainer):
        ours = torch.tensor(g.unscaled_logprobs)
        assert_close(ours, lp[len(PROMPTS[g.prompt_index]) - 1 :], atol=1e-5, rtol=0)
        if temperature == 1.0:
            assert_close(torch.tensor(g.logprobs), ours, atol=1e-6, rtol=0)
    # the actor's policy is softmax(logits / T) (verl's convention): its log-probs are the rollout's
    actor = Actor(model, ActorConfig(compute_dtype="float32"), total_steps=1, max_response_tokens=20,
                  pad_token_id=0, temperature=temperature)  # fmt: skip
    batch = TrainingBatch(
        [PROMPTS[g.prompt_index] for g in out],
        [g.token_ids for g in out],
        pad_ragged([[1.0] * len(g.token_ids) for g in out]),
    )
    assert_close(actor.log_probs(batch)[0], pad_ragged([g.logprobs for g in out]), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.3, top_k=4),
        SamplingParams(temperature=0.8, top_p=0.7),
    ],
    ids=["t1", "t0.5", "topk", "topp"],
)
def test_sampling_frequencies_match_the_distribution(params):
    """Chi-square over 40,000 draws (one per seed) of an 8-token distribution, p = 0.001."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    draws = 40_000
    tokens, logp, _ = sample_reference(
        logits.expand(draws, -1), params, torch.arange(draws), torch.zeros(draws, dtype=torch.long)
    )
    from hybridflow.rollout.sampling import warp_logits

    probs = torch.softmax(warp_logits(logits, params), -1)[0]
    assert_close(logp, probs[tokens].log(), atol=1e-5, rtol=0)
    counts = torch.bincount(tokens, minlength=8).double()
    support = probs > 0
    assert counts[~support].sum() == 0  # top-k / top-p removed tokens are never drawn
    expected = probs[support].double() * draws
    chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
    critical = {8: 24.32, 4: 16.27, 3: 13.82, 2: 10.83, 1: 10.83}[int(support.sum())]  # df = k - 1
    assert chi2 < critical, (chi2, counts.tolist(), expected.tolist())


def test_a_long_tail_is_drawn_as_often_as_its_mass_along_a_sequence():
    """A language model's row: one dominant token, a few plausible ones, 32k in a tail each below
    1e-3. Drawn as the engine draws (each sequence's seed fixed, its step counting up), tokens of the
    tail come up as often as their mass says (Poisson, 4 sigma); stray tokens in a real model's
    samples are then the model's tail, not the noise's."""
    torch.manual_seed(0)
    sequences, steps, vocab = 256, 32, 32_768
    logits = torch.randn(sequences, vocab) * 1.5  # [S, V]
    logits[:, :5] += torch.tensor([12.0, 8.0, 7.0, 6.0, 5.0])
    probs = torch.softmax(logits, -1)
    tail = probs < 1e-3
    expected = steps * (probs * tail).sum().item()
    seeds = torch.randint(0, 2**40, (sequences,))
    drawn = 0
    for step in range(steps):
        tokens, _, _ = sample_reference(
            logits, SamplingParams(temperature=1.0), seeds, torch.full((sequences,), step)
        )
        drawn += tail[torch.arange(sequences), tokens].sum().item()
    assert expected > 300  # enough mass for the bound to mean something
    assert abs(drawn - expected) < 4 * expected**0.5, (drawn, expected)


def test_sampler_noise_in_int32_is_the_int64_hash_and_both_draws_agree():
    """The noise is computed in int32 (the low 31 bits of a wrapping product are the int64
    product's): equal to mix31 in int64 at the edges of the 31-bit range and over a vocabulary that is
    no multiple of the vector width; the dense draw (plain sampling) picks what the pruned draw (only
    entries within GUMBEL_SPAN of the best get noise, top-k / top-p's path) picks."""
    from hybridflow.engine.sampler import GUMBEL_SPAN, gumbel_noise, mix31, step_keys

    keys = torch.tensor([0, 1, 12345, 2**30 + 7, 2**31 - 2, 2**31 - 1])[:, None]  # [6, 1]
    cols = torch.arange(1003)
    bits = mix31(keys ^ cols) >> 8
    assert torch.equal(gumbel_noise(keys, cols), -torch.log(-torch.log((bits.float() + 0.5) / (1 << 23))))
    torch.manual_seed(0)
    for scale, temperature in ((0.5, 1.0), (4.0, 1.0), (4.0, 0.7)):
        logits = torch.randn(16, 1003) * scale
        seeds, steps = torch.randint(0, 2**40, (16,)), torch.randint(0, 999, (16,))
        params = SamplingParams(temperature=temperature)
        tokens, logp, unscaled = sample_reference(logits, params, seeds, steps)
        warped = torch.log_softmax(logits / temperature, -1)
        rows, hit = (warped >= warped.max(-1, keepdim=True).values - GUMBEL_SPAN).nonzero(as_tuple=True)
        scores = torch.full_like(warped, float("-inf"))
        scores[rows, hit] = warped[rows, hit] + gumbel_noise(step_keys(seeds, steps)[rows], hit)
        assert torch.equal(tokens, scores.argmax(-1))
        assert_close(logp, warped.gather(-1, tokens[:, None])[:, 0], atol=1e-6, rtol=0)


def test_the_noise_is_finite_for_every_hash_value_so_no_entry_wins_whatever_its_logit():
    """Every uniform lies strictly inside (0, 1): the noise of all 2^23 values is finite, in
    [-2.82, 16.64]. (With 24 bits the largest uniform rounded to 1.0 and its noise was +inf: that entry
    won whatever its logit, ~0.9% of the draws over a 152k vocabulary.) Seed 34445's first step hashes
    entry 37 to all ones (in 24 bits too): at a logit 30 below the rest it is never drawn."""
    from hybridflow.engine.sampler import NOISE_BITS, gumbel_of_bits, mix31, step_keys

    noise = gumbel_of_bits(torch.arange(1 << NOISE_BITS, dtype=torch.int32))
    assert torch.isfinite(noise).all() and noise.min() > -2.82 and noise.max() < 16.64
    seeds, steps = torch.tensor([34445]), torch.tensor([0])
    assert (mix31(step_keys(seeds, steps) ^ 37) >> (31 - NOISE_BITS)).item() == (1 << NOISE_BITS) - 1
    logits = torch.zeros(1, 300)
    logits[0, 37] = -30.0
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=299)):
        token, _, _ = sample_reference(logits, params, seeds, steps)
        assert token.item() != 37


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3"])
def test_cpu_onednn_layers_equal_the_trainers_modules_and_follow_weight_changes(family):
    """On CPU in fp32 the engine runs its matmuls through oneDNN on packed copies of the weights
    (engine/cpu_layers.py): the same tokens and log-probs as the trainer's modules (qwen2: biased
    q/k/v; qwen3: q/k norms; llama3: untied head), and new packed copies once the shared module's
    weights change in place (an optimizer step) or a parameter is replaced."""
    from hybridflow.engine.cpu_layers import onednn_available

    if not onednn_available():
        pytest.skip("this torch has no oneDNN")
    model = from_hf_model(tiny_model(family, seed=5))
    packed = _engine(model, max_context_tokens=64)
    plain = _engine(model, max_context_tokens=64, fused_decode=False)
    assert packed.runner.cpu_layers is not None and plain.runner.cpu_layers is None
    params = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=2)

    def same(a, b):
        assert [g.token_ids for g in a] == [g.token_ids for g in b]
        for x, y in zip(a, b):
            assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)

    before = packed.generate(PROMPTS, params)
    same(before, plain.generate(PROMPTS, params))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    after = packed.generate(PROMPTS, params)
    assert [g.token_ids for g in after] != [g.token_ids for g in before]
    same(after, plain.generate(PROMPTS, params))
    down = model.model.layers[-1].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.randn_like(down.weight), requires_grad=False)
    same(packed.generate(PROMPTS, params), plain.generate(PROMPTS, params))


def test_prompt_pages_are_shared_then_copied_on_write():
    cache = KVCache(
        num_layers=1,
        num_pages=10,
        page_size=4,
        kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    cache.k.normal_()
    scheduler = Scheduler(cache, max_sequences=8, max_prefill_tokens=64, max_pages_per_sequence=4)
    seqs = [Sequence(i, 0, list(range(6)), 6, seed=i) for i in range(3)]
    scheduler.add(PrefillJob(seqs))
    (job,) = scheduler.schedule_prefill()
    assert all(s.pages == seqs[0].pages for s in seqs) and len(seqs[0].pages) == 2
    assert [cache.pool.refs[p] for p in seqs[0].pages] == [3, 3]
    for s in seqs:  # prefilled 6 tokens, sampled one each
        s.cached, s.tokens = 6, s.tokens + [9]
    scheduler.schedule_decode()
    full, partial = seqs[0].pages[0], seqs[2].pages[1]
    assert all(s.pages[0] == full for s in seqs) and cache.pool.refs[full] == 3  # full page still shared
    lasts = [s.pages[1] for s in seqs]
    assert len(set(lasts)) == 3 and all(cache.pool.refs[p] == 1 for p in lasts)  # private last pages
    for p in lasts:
        assert torch.equal(cache.k[0, p * 4 : p * 4 + 2], cache.k[0, partial * 4 : partial * 4 + 2])
    assert [scheduler.table[s.row, :2].tolist() for s in seqs] == [s.pages for s in seqs]  # host page table
    for s in seqs:
        scheduler.finish(s)
    assert cache.pool.num_free == cache.pool.num_pages and not any(cache.pool.refs)


@pytest.mark.parametrize("prompt_tokens, admitted", [(6, True), (8, False)], ids=["partial", "full"])
def test_a_request_is_admitted_when_its_prompt_and_first_steps_fit_exactly(prompt_tokens, admitted):
    """Three samples of a prompt in a pool of 4 free pages of 4 tokens: a 6-token prompt takes 2 and
    its first steps 2 copies of the shared partial page (the third sample writes in place): admitted,
    and all three decode without a preemption. An 8-token prompt's first steps need 3 fresh pages
    (2 + 3 > 4): it waits."""
    cache = KVCache(
        num_layers=1, num_pages=5, page_size=4, kv_heads=1, head_dim=2, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert cache.pool.num_free == 4
    scheduler = Scheduler(cache, max_sequences=8, max_prefill_tokens=64, max_pages_per_sequence=4)
    seqs = [Sequence(i, 0, list(range(prompt_tokens)), prompt_tokens, seed=i) for i in range(3)]
    scheduler.add(PrefillJob(seqs))
    assert bool(scheduler.schedule_prefill()) is admitted
    if admitted:
        for s in seqs:
            s.cached, s.tokens = prompt_tokens, s.tokens + [9]
        assert scheduler.schedule_decode() == seqs and scheduler.preemptions == 0
        assert cache.pool.num_free == 0


def test_no_page_leaks_across_generate_sleep_wake_and_errors_are_clear():
    model = from_hf_model(tiny_model("mistral", seed=5))
    engine = _engine(model, max_context_tokens=64, kv_cache_tokens=120)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=2)
    first = engine.generate(PROMPTS, params)
    engine.sleep()
    assert engine.cache.k is None
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, params)
    engine.wake()
    again = engine.generate(PROMPTS, params)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    pool = engine.cache.pool
    assert pool.num_free == pool.num_pages and not any(pool.refs)
    with pytest.raises(UserError, match="prompt 1 has 64 tokens; the engine takes 1 to 63"):
        engine.generate([[1], [2] * 64], params)
    with pytest.raises(UserError, match="cannot hold one sequence of max_context_tokens=64"):
        _engine(model, max_context_tokens=64, kv_cache_tokens=32)


def test_max_tokens_and_context_limit_stop_with_length():
    model = from_hf_model(tiny_model("qwen2", seed=6))
    out = _engine(model, eos=(), max_context_tokens=40).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=25)
    )
    assert [len(g.token_ids) for g in out] == [25, 25, 10, 25]  # the 30-token prompt hits the context limit
    assert all(g.finish_reason == "length" for g in out)


def test_update_weights_copies_into_the_engines_own_weights():
    """A bf16 engine keeps its own copy; after update_weights it generates what a fresh copy of the
    updated policy generates."""
    policy = from_hf_model(tiny_model("qwen2", seed=7))  # tied embeddings
    engine = _engine(policy, max_context_tokens=64, compute_dtype="bfloat16")
    assert engine.model is not policy and engine.model.lm_head.weight.dtype == torch.bfloat16
    assert engine.model.model.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    params = SamplingParams(n=2, temperature=0, max_tokens=12)
    written = engine.update_weights(policy.named_parameters())
    assert written > 0
    fresh = _engine(policy, max_context_tokens=64, compute_dtype="bfloat16")
    assert [g.token_ids for g in engine.generate(PROMPTS, params)] == [
        g.token_ids for g in fresh.generate(PROMPTS, params)
    ]
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])


def test_triton_kernels_match_their_references_in_the_interpreter():
    stdout = in_triton_interpreter("triton_kernels_check.py")
    # 5 attention cases (one split and several), 6 sampler (a row in one program and in slices),
    # the fused step's norm, rotary + store and SwiGLU for two families, its on-device draw
    assert stdout.count("max abs err") == 18
    assert "record and advance as expected True" in stdout
    assert "the far less likely entry drawn False" in stdout  # the largest noise is finite
    assert stdout.count("log-prob head") == 2  # the training LM head's softmax kernels
    assert "every element in place True" in stdout  # the weight update's multi-tensor copy
    assert stdout.count("nothing else written True") == 2  # the K/V store, two families


@pytest.mark.slow
def test_every_triton_kernel_compiles_for_an_h100_without_one():
    """The interpreter runs kernels that a GPU's compiler refuses (a tl.dot over 4 keys did, while this
    check was written): every kernel of hybridflow's Triton modules, as a small workload launches it
    in the interpreter (the exact and fused engines, the exact trainer's forward and backward, the
    matmul's forms, what runs only on a GPU), is compiled for sm_90 with each launch's argument types
    and constants (triton.compile; ~1.5 minutes on 2 cores)."""
    stdout = in_triton_interpreter("sm90_compile_check.py", timeout=1200)
    assert "not launched" not in stdout and "FAILED" not in stdout
    assert stdout.count("compiles for sm_90: ") >= 27
    for kernel in ("kernels.linear._tma_partial_kernel", "kernels.linear._sum_partials_kernel",
                   "kernels.rms_norm._rms_norm_backward_kernel", "kernels.packed_attention._backward_dq_kernel",
                   "engine.triton_layer._rope_store_kernel", "engine.triton_decode._merge_splits_kernel"):  # fmt: skip
        assert f"compiles for sm_90: hybridflow.{kernel} " in stdout


def test_fused_decode_step_equals_the_trainers_modules_in_the_interpreter():
    """The engine's fused decode (engine/fused_decode.py) end to end on CPU tensors, in Triton's
    interpreter: the same tokens, stops and log-probs as the trainer's modules, with fused
    projections (and after a weight update into them) and with the trainer's own module."""
    stdout = in_triton_interpreter("fused_decode_check.py")
    assert stdout.count("same tokens and stops True") == 6
    assert stdout.count("from the prefix cache (True)") == 2
    assert "same tokens as a fresh engine True" in stdout


def test_decode_runs_launched_ahead_change_no_requests_output_in_the_interpreter():
    """A run launched before the last is read (the host's work beside the device's) gives each request
    the tokens of an engine that never runs ahead, while requests are added, aborted, paused and
    given new weights between steps; and with speculation on, while too many sequences run to
    speculate, its run ahead read before a speculative step (scripts/run_ahead_check.py)."""
    stdout = in_triton_interpreter("run_ahead_check.py")
    assert "request outputs equal True over 9 samples (['abort', 'length', 'stop'])" in stdout
    assert "none without fused steps True" in stdout and "every page back in the pool True" in stdout
    assert (
        "with speculation: outputs equal True over 8 samples, a run ahead pending while few enough ran"
        in stdout
    )


def test_engine_copy_fuses_projections_and_updates_land_in_them():
    from hybridflow.engine.fused_decode import layer_weights

    model = from_hf_model(tiny_model("qwen2", seed=3))  # biased q/k/v
    engine = _engine(model, share_weights=False, max_context_tokens=64)
    layers = layer_weights(engine.model)
    attn = engine.model.model.layers[0].self_attn
    (qkv, qkv_bias), = layers[0].qkv  # fmt: skip
    assert qkv.shape[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    assert qkv.data_ptr() == attn.q_proj.weight.data_ptr() and qkv_bias is not None
    assert len(layers[0].gate_up) == 1
    assert len(layer_weights(model)[0].qkv) == 3  # the trainer's module: separate projections
    engine.update_weights(
        [("model.layers.0.self_attn.k_proj.weight", torch.full_like(attn.k_proj.weight, 0.5))]
    )
    rows = slice(attn.q_proj.out_features, attn.q_proj.out_features + attn.k_proj.out_features)
    assert torch.equal(qkv[rows], torch.full_like(attn.k_proj.weight, 0.5))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    fresh_model = from_hf_model(tiny_model("qwen2", seed=3))
    with torch.no_grad():
        fresh_model.model.layers[0].self_attn.k_proj.weight.fill_(0.5)
    assert [g.token_ids for g in engine.generate(PROMPTS, params)] == [
        g.token_ids for g in _engine(fresh_model, max_context_tokens=64).generate(PROMPTS, params)
    ]


@pytest.mark.slow
def test_default_model_greedy_equals_transformers():
    from hybridflow.models import load_causal_lm

    hf, tok = load_causal_lm("default")
    texts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("What is 17 + 25?", "Name a prime number bigger than 10.", "Hi")
    ]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    params = SamplingParams(n=2, temperature=0, max_tokens=24)
    eos = [tok.eos_token_id]
    ref = HFBackend(hf, pad_token_id=tok.pad_token_id, eos_token_ids=eos).generate(prompts, params)
    out = Engine(from_hf_model(hf), eos_token_ids=eos, config=EngineConfig(max_context_tokens=256)).generate(
        prompts, params
    )
    assert [g.token_ids for g in out] == [g.token_ids for g in ref]


def test_the_kv_pool_is_sized_from_free_memory_the_cap_or_the_tokens_asked():
    """Hand-computed pool sizes: 4,096-token contexts in pages of 64 are 64 pages a sequence."""
    c = EngineConfig(max_context_tokens=4096, page_size=64, max_batch_sequences=8, gpu_memory_utilization=0.5)
    mib = 2**20
    assert pool_pages(c, page_bytes=mib, free_bytes=200 * mib) == 100  # half of 200 MiB, 1 MiB a page
    assert pool_pages(c, page_bytes=mib, free_bytes=10_000 * mib) == 512  # capped: 8 sequences x 64 pages
    assert pool_pages(c, page_bytes=mib, free_bytes=None) == 512  # off the GPU: the cap
    assert (
        pool_pages(replace(c, kv_cache_tokens=6500), page_bytes=mib, free_bytes=None) == 102
    )  # ceil(6500 / 64)
    with pytest.raises(UserError, match="engine KV cache of 50 pages .* cannot hold one sequence"):
        pool_pages(c, page_bytes=mib, free_bytes=100 * mib)  # 50 pages < 64 + 1
