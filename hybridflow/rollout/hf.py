"""Reference rollout backend: transformers `generate` with left padding, returning sampled log-probs."""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from hybridflow.devices import follow_free_cores
from hybridflow.rollout.sampling import Generation, NonFiniteLogits, SamplingParams, warp_logits


class _FollowFreeCores(LogitsProcessor):
    """Between two of generate's steps, torch's CPU threads follow the cores other work leaves free
    (devices.follow_free_cores); the scores pass unchanged."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        follow_free_cores()
        return scores


class _WarpAndRecord(LogitsProcessor):
    """Warps logits our way and records the log-prob of each token the sampler then picks.

    A processor sees the token sampled at step t only at step t+1 (as the last input id), so it keeps
    one step of log-probs [B, V] and gathers from it then; the last step is gathered after generate.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.previous: torch.Tensor | None = None  # [B, V] log-probs of the last step
        self.logprobs: list[torch.Tensor] = []  # per step [B]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.record(input_ids[:, -1])
        if not torch.isfinite(scores).all():
            raise NonFiniteLogits("the model produced NaN or inf logits during generation")
        warped = warp_logits(scores, self.params)  # [B, V]
        self.previous = torch.log_softmax(warped.float(), dim=-1)
        return warped

    def record(self, tokens: torch.Tensor) -> None:
        assert self.previous is not None
        self.logprobs.append(self.previous.gather(-1, tokens[:, None])[:, 0])


class HFBackend:
    """Batched `model.generate`; prompts are left-padded, responses cut at their first stop token."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        eos_token_ids: list[int],
        max_batch_sequences: int = 256,
    ) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_batch_sequences = max_batch_sequences

    @torch.no_grad()
    def update_weights(self, named_tensors) -> None:
        """Copy tensors into the model by name, in place (skipped when they are the model's own)."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if params[name].data_ptr() != tensor.data_ptr():
                params[name].copy_(tensor)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def sleep(self) -> None:
        """Nothing to free: transformers' generate holds no memory between calls."""

    def wake(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Generation]:
        """n generations per prompt, prompt-major: outputs[i * n + j] is sample j of prompt i."""
        if params.seed is not None:  # a shard of a split call gets its own stream
            torch.manual_seed(params.seed + 1_000_003 * params.first_sequence)
        requests = [(i, p) for i, p in enumerate(prompt_token_ids) for _ in range(params.n)]
        outputs: list[Generation] = []
        for start in range(0, len(requests), self.max_batch_sequences):
            outputs += self._generate_chunk(requests[start : start + self.max_batch_sequences], params)
        return outputs

    def _generate_chunk(
        self, requests: list[tuple[int, list[int]]], params: SamplingParams
    ) -> list[Generation]:
        device = self.model.device
        width = max(len(p) for _, p in requests)
        input_ids = torch.full((len(requests), width), self.pad_token_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros_like(input_ids)
        for row, (_, prompt) in enumerate(requests):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        stops = sorted(set(self.eos_token_ids) | set(params.stop_token_ids))
        recorder = _WarpAndRecord(params)
        # A fresh GenerationConfig so the checkpoint's own sampling defaults never leak in;
        # all warping is done by our processor, HF only samples from (or argmaxes) what it returns.
        config = GenerationConfig(
            do_sample=not params.greedy,
            temperature=1.0,
            top_p=1.0,
            top_k=None,
            max_new_tokens=params.max_tokens,
            eos_token_id=stops,
            pad_token_id=self.pad_token_id,
        )
        sequences = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            generation_config=config,
            logits_processor=LogitsProcessorList(
                [recorder, *([_FollowFreeCores()] if device.type == "cpu" else [])]
            ),
        )
        new_tokens = sequences[:, width:].cpu()  # [B, T]
        if new_tokens.shape[1] > len(recorder.logprobs):
            recorder.record(sequences[:, -1])
        logprobs = torch.stack(recorder.logprobs, dim=1).cpu()  # [B, T]
        results = []
        for row, (prompt_index, _) in enumerate(requests):
            tokens = new_tokens[row].tolist()
            end, reason = len(tokens), "length"
            for t, token in enumerate(tokens):
                if token in stops:
                    end, reason = t + 1, "stop"
                    break
            results.append(Generation(prompt_index, tokens[:end], logprobs[row, :end].tolist(), reason))
        return results
