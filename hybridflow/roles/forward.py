"""Model forward passes shared by the actor, reference and critic: packed without padding for our
native models, padded micro-batches for any other transformers model."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from hybridflow.algorithms.losses import entropy_from_logits
from hybridflow.batch import pack_sequences, plan_grouped_microbatches, plan_microbatches
from hybridflow.devices import DTYPES, follow_free_cores, to_device
from hybridflow.errors import UserError
from hybridflow.parallel.collectives import max_over_ranks


def autocast(device: torch.device, compute_dtype: str):
    """bf16/fp16 autocast around forward/backward; 'float32' is off and 'auto' is bf16 on CUDA only
    (CPUs without AMX run bf16 matmuls far slower than fp32)."""
    if compute_dtype == "auto":
        compute_dtype = "bfloat16" if device.type == "cuda" else "float32"
    if compute_dtype == "float32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[compute_dtype])


def right_padded_inputs(prompt_ids: list[list[int]], response_ids: list[list[int]], device, pad_id: int = 0):
    """input_ids and attention_mask [b, L] for prompt+response sequences, right-padded."""
    seqs = [p + r for p, r in zip(prompt_ids, response_ids)]
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
    return input_ids.to(device), attention.to(device)


def response_slices(hidden: torch.Tensor, prompt_ids: list[list[int]], width: int) -> torch.Tensor:
    """Rows of `hidden` [b, L, ...] at the positions that predict each response token -> [b, width, ...].
    Position P-1+t predicts response token t (P = prompt length)."""
    b = hidden.shape[0]
    starts = torch.tensor([len(p) - 1 for p in prompt_ids], device=hidden.device)  # [b]
    pos = (starts[:, None] + torch.arange(width, device=hidden.device)[None, :]).clamp(
        max=hidden.shape[1] - 1
    )  # [b, T]
    index = pos.view(b, width, *([1] * (hidden.dim() - 2))).expand(b, width, *hidden.shape[2:])
    return hidden.gather(1, index)


def response_logprobs(
    logits: torch.Tensor,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each response token [b, T] under softmax(logits / temperature) (float32, zero past
    each response) and optionally the entropy of each predicting distribution (differentiable only
    with `entropy_grad`, which costs memory). One row at a time, so float32 [R, V] is the largest
    temporary."""
    width = max(len(r) for r in response_ids)
    logps, entropies = [], []
    # unbind once: indexing logits[i] per row would make backward build a full [b, L, V] gradient per row
    for row_logits, p, r in zip(logits.unbind(0), prompt_ids, response_ids):
        row = row_logits[len(p) - 1 : len(p) - 1 + len(r)].float() / temperature  # [R, V]
        targets = torch.tensor(r, dtype=torch.long, device=logits.device)[:, None]  # [R, 1]
        logps.append(F.pad(torch.log_softmax(row, -1).gather(-1, targets)[:, 0], (0, width - len(r))))
        if with_entropy:
            entropies.append(
                F.pad(entropy_from_logits(row if entropy_grad else row.detach()), (0, width - len(r)))
            )
    return torch.stack(logps), (torch.stack(entropies) if with_entropy else None)


def shares_prompts(model) -> bool:
    """Whether the model's log-prob forward packs a prompt once for all its responses (the native
    model, unless sequence parallelism splits the packing)."""
    return hasattr(model, "hidden_states") and model.model.sequence_parallel is None


def microbatches(
    batch_lengths: list[int],
    max_tokens: int,
    max_sequences: int | None,
    *,
    prompt_ids: list[list[int]] | None = None,
) -> list[list[int]]:
    """This rank's micro-batch plan; with `prompt_ids`, a prompt's sequences kept together."""
    if prompt_ids is None:
        return plan_microbatches(batch_lengths, max_tokens, max_sequences)
    responses = [n - len(p) for n, p in zip(batch_lengths, prompt_ids)]
    return plan_grouped_microbatches(prompt_ids, responses, max_tokens, max_sequences)


def in_step_microbatches(
    batch_lengths: list[int],
    max_tokens: int,
    max_sequences: int | None,
    *,
    prompt_ids: list[list[int]] | None = None,
) -> list[tuple[list[int], bool]]:
    """(rows, is_padding) per micro-batch, as many on every data-parallel rank: a sharded model
    gathers its weights in every forward, a collective that all ranks must reach. A rank with fewer
    micro-batches repeats its first one as padding, whose results are discarded. With `prompt_ids`
    (a model that `shares_prompts`) the sequences of a prompt stay together where they fit."""
    plan = microbatches(batch_lengths, max_tokens, max_sequences, prompt_ids=prompt_ids)
    return [(plan[i], False) if i < len(plan) else (plan[0], True) for i in range(max_over_ranks(len(plan)))]


def packed_inputs(prompt_ids: list[list[int]], response_ids: list[list[int]], device: torch.device):
    """Prompt+response sequences packed without padding -> (input_ids, position_ids on `device`,
    cu_seqlens on the host), and the packed positions that predict each response token [R] (flattened in order)."""
    packed = pack_sequences([p + r for p, r in zip(prompt_ids, response_ids)])
    starts = packed.cu_seqlens.tolist()
    # position s_b + P_b - 1 + t predicts response token t of sequence b
    index = torch.tensor(
        [s + len(p) - 1 + t for s, p, r in zip(starts, prompt_ids, response_ids) for t in range(len(r))],
        dtype=torch.long,
    )  # [R]
    # cu_seqlens stay on the host: the model reads the boundaries there without a device sync
    inputs = (to_device(packed.input_ids, device), to_device(packed.position_ids, device), packed.cu_seqlens)
    return inputs, to_device(index, device)


def packed_routes(
    model,
    routes: list[torch.Tensor | None],
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    device,
) -> torch.Tensor:
    """Each sequence's recorded experts in the plain packing's token order, [N, MoE layers, k] int64;
    -1 where the router chooses: a sequence recorded without routes, and each sequence's last token
    (never fed to the rollout's model; it predicts nothing that is trained)."""
    moe = model.config.moe
    if moe is None:
        raise UserError("router replay needs a mixture-of-experts policy; this one is dense")
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids)]
    out = torch.full((sum(lengths), len(moe.sparse_layers), moe.top_k), -1, dtype=torch.int64)
    start = 0
    for n, kept in zip(lengths, routes):
        if kept is not None:
            if kept.shape[1:] != out.shape[1:] or len(kept) > n:
                raise UserError(
                    f"recorded routes of shape {tuple(kept.shape)} do not fit a sequence of {n} tokens "
                    f"through {out.shape[1]} MoE layers of top-{out.shape[2]} experts"
                )
            out[start : start + len(kept)] = kept
        start += n
    return to_device(out, device)


def unflatten_responses(flat: torch.Tensor, response_ids: list[list[int]]) -> torch.Tensor:
    """[R] values of all response tokens in order -> [b, T] right-padded with zeros."""
    width = max(len(r) for r in response_ids)
    parts = torch.split(flat, [len(r) for r in response_ids])
    return torch.stack([F.pad(x, (0, width - len(x))) for x in parts])


def packed_response_logprobs(
    model,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    *,
    device: torch.device,
    compute_dtype: str,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    temperature: float = 1.0,
    routes: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The native model's path: sequences packed without padding, the LM head applied only at the
    positions that predict response tokens, in chunks. Returns [b, T] like `response_logprobs`.
    `routes`: per sequence, the experts the rollout routed its tokens to (router replay), or None."""
    from hybridflow.models.native import chunked_token_logprobs
    from hybridflow.models.native.shared_prefix import has_shared_prompts, pack_shared_prompts

    if device.type == "cpu":
        follow_free_cores()  # a micro-batch at a time: torch's threads on the cores left free
    if routes is None and shares_prompts(model) and has_shared_prompts(prompt_ids):
        packing = pack_shared_prompts(prompt_ids, response_ids, device)  # each prompt once per group
        inputs = (packing.input_ids, packing.position_ids, packing.cu_seqlens, packing.shared)
        index = packing.index
    else:  # (replayed routes follow each whole sequence: packed as they are)
        inputs, index = packed_inputs(prompt_ids, response_ids, device)
        if routes is not None:
            inputs = (*inputs, None, packed_routes(model, routes, prompt_ids, response_ids, device))
    targets = to_device(torch.tensor([t for r in response_ids for t in r], dtype=torch.long), device)  # [R]
    with autocast(device, compute_dtype):
        chosen = model.hidden_states(*inputs).index_select(0, index)  # [R, H]
        logp, entropy = chunked_token_logprobs(
            chosen, model.lm_head.weight, targets, temperature=temperature, exact=model.exact_kernels
        )  # [R] each
        # differentiable entropy needs the [R, V] logits; a tensor-parallel head's carries its gradient
        if with_entropy and entropy_grad and not isinstance(model.lm_head.weight, DTensor):
            entropy = entropy_from_logits(model.lm_head(chosen) / temperature)
    return (
        unflatten_responses(logp, response_ids),
        unflatten_responses(entropy, response_ids) if with_entropy else None,
    )


def policy_logprobs(
    model,
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    *,
    device: torch.device,
    compute_dtype: str,
    pad_token_id: int,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    temperature: float = 1.0,
    routes: list[torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Response-token log-probs [b, T] of a policy at a sampling temperature (softmax(logits / T), as
    the rollout sampled): packed for the native model, padded for any other transformers model.
    `routes`: router replay's recorded experts per sequence (the native model only)."""
    if hasattr(model, "hidden_states"):
        return packed_response_logprobs(
            model, prompt_ids, response_ids, device=device, compute_dtype=compute_dtype,
            with_entropy=with_entropy, entropy_grad=entropy_grad, temperature=temperature, routes=routes,
        )  # fmt: skip
    if routes is not None:
        raise UserError(
            "router replay runs in our model (model.impl=native); this policy is a transformers model"
        )
    input_ids, attention = right_padded_inputs(prompt_ids, response_ids, device, pad_token_id)
    with autocast(device, compute_dtype):
        logits = model(input_ids=input_ids, attention_mask=attention, use_cache=False).logits  # [b, L, V]
    return response_logprobs(
        logits, prompt_ids, response_ids, with_entropy=with_entropy, entropy_grad=entropy_grad,
        temperature=temperature,
    )  # fmt: skip
