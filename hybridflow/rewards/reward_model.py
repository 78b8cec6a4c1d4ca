"""A learned reward: a sequence-classification model scoring prompt + response with the chat template."""

from __future__ import annotations

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hybridflow.batch import plan_microbatches
from hybridflow.errors import UserError


class RewardModel:
    """Scalar score of each (prompt messages, response) pair; micro-batched by token budget."""

    def __init__(
        self, path: str, *, device: torch.device | str = "cpu", max_tokens_per_microbatch: int = 8192
    ) -> None:
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
            width = max(len(ids[i]) for i in rows)
            # right padding: the classification head reads the last non-pad token
            batch = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(batch)
            for j, i in enumerate(rows):
                batch[j, : len(ids[i])] = torch.tensor(ids[i])
                mask[j, : len(ids[i])] = 1
            logits = self.model(input_ids=batch.to(self.device), attention_mask=mask.to(self.device)).logits[
                :, 0
            ]
            out[rows] = logits.float().cpu()
        return out
