"""A learned reward: a sequence-classification model scoring prompt + response with the chat template."""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hybridflow.batch import pack_sequences, plan_microbatches
from hybridflow.errors import UserError
from hybridflow.models import native


class RewardModel:
    """Scalar score of each (prompt messages, response) pair; micro-batched by token budget."""

    def __init__(
        self,
        path: str,
        *,
        device: torch.device | str = "cpu",
        max_tokens_per_microbatch: int = 8192,
        impl: str = "auto",
    ) -> None:
        """impl 'auto' scores with our packed model when the family is supported, 'hf' with transformers."""
        try:
            self.model = (
                AutoModelForSequenceClassification.from_pretrained(path, num_labels=1).eval().to(device)
            )
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as e:
            raise UserError(
                f"reward.model_path={path}: cannot load a sequence-classification model ({str(e).splitlines()[0]})"
            ) from e
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = torch.device(device)
        self.max_tokens = max_tokens_per_microbatch
        if impl != "hf" and native.supports(self.model.config):  # packed, no padding
            self.model = native.score_model_from_hf(self.model)

    def _text(self, prompt: list[dict] | str, response: str) -> str:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages = [*messages, {"role": "assistant", "content": response}]
        if self.tokenizer.chat_template is None:
            return "\n".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    @torch.no_grad()
    def score(self, prompts: list[list[dict] | str], responses: list[str]) -> torch.Tensor:
        """[B] float scores."""
        ids = [
            self.tokenizer(self._text(p, r), add_special_tokens=False)["input_ids"]
            for p, r in zip(prompts, responses)
        ]
        out = torch.zeros(len(ids))
        for rows in plan_microbatches([len(x) for x in ids], self.max_tokens):
            chunk = [ids[i] for i in rows]
            scorer = (
                self._packed_scores
                if isinstance(self.model, native.NativeScoreModel)
                else self._padded_scores
            )
            out[rows] = scorer(chunk).float().cpu()
        return out

    def _padded_scores(self, ids: list[list[int]]) -> torch.Tensor:
        width = max(map(len, ids))
        # right padding: the classification head reads the last non-pad token
        batch = torch.full((len(ids), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(batch)
        for j, seq in enumerate(ids):
            batch[j, : len(seq)] = torch.tensor(seq)
            mask[j, : len(seq)] = 1
        return self.model(input_ids=batch.to(self.device), attention_mask=mask.to(self.device)).logits[:, 0]

    def _packed_scores(self, ids: list[list[int]]) -> torch.Tensor:
        packed = pack_sequences(ids)
        # transformers reads the rightmost token that is not the pad token; so do we, for equal scores
        pad, starts = self.tokenizer.pad_token_id, packed.cu_seqlens.tolist()
        last = [
            s + max((i for i, t in enumerate(seq) if t != pad), default=len(seq) - 1)
            for s, seq in zip(starts, ids)
        ]
        inputs = (packed.input_ids, packed.position_ids, packed.cu_seqlens)
        return self.model.scores_at(
            *(t.to(self.device) for t in inputs), torch.tensor(last, device=self.device)
        )[:, 0]
