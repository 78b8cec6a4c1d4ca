"""An episode's running token list, kept an exact prefix of what the chat template renders.

The model's turns enter as the tokens it sampled (never re-tokenized). Every other message (a tool's
result, an environment's answer) enters as the template's own text for it, found as the part of the
whole conversation's rendering that follows what the model has seen so far. When the rendering no
longer begins with the model's history (a template that rewrites earlier turns, e.g. Qwen3 dropping
earlier `<think>` blocks), the episode starts a new segment whose prompt is the rendering: the
trainer never sees a history that the model did not see, and the rewrite is counted."""

from __future__ import annotations

from hybridflow.agents.model import Completion
from hybridflow.agents.trajectory import Trajectory
from hybridflow.errors import UserError


class Conversation:
    def __init__(
        self, tokenizer, messages: list[dict], *, tools: list[dict] | None = None, **template_kwargs
    ):
        self.tokenizer, self.messages, self.tools = tokenizer, list(messages), tools
        self.template_kwargs = template_kwargs
        text = self._render()
        self.tokens = self._encode(text)
        if self._decode(self.tokens) != text:
            raise UserError(
                f"{type(tokenizer).__name__} does not decode its own chat template's tokens back to the same "
                "text; multi-turn episodes need that to keep the model's history token for token"
            )
        self.segments = [Trajectory(prompt_ids=list(self.tokens))]
        self.rewrites = 0  # times the template rewrote the history (each began a segment)
        self.response_tokens = 0  # tokens after the first prompt, in every segment

    def room(self, max_response_tokens: int, max_context_tokens: int) -> int:
        """Tokens the episode may still add: what is left of its response budget and of the context."""
        return min(max_response_tokens - self.response_tokens, max_context_tokens - len(self.tokens) - 1)

    @property
    def current(self) -> Trajectory:
        return self.segments[-1]

    def _render(self, messages: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages if messages is None else messages,
            tools=self.tools,
            tokenize=False,
            add_generation_prompt=True,
            **self.template_kwargs,
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    async def model_turn(self, model, max_response_tokens: int, max_tokens_per_turn: int = 0):
        """The model's next turn, appended: (its text, the Completion); None when the response budget
        or the context has no token left."""
        room = self.room(max_response_tokens, model.max_context_tokens)
        if room <= 0:
            return None
        completion = await model.generate(self.tokens, max_tokens=min(room, max_tokens_per_turn or room))
        return self.add_model_turn(completion), completion

    def add_model_turn(self, completion: Completion) -> str:
        """Append the sampled tokens; returns the turn's text (its final stop token left out), which
        the history holds as the assistant's message, exactly as the model wrote it."""
        ids = completion.token_ids
        self.tokens += ids
        self.current.add_sampled(ids, completion.logprobs, completion.weight_versions)
        self.current.turns += 1
        self.response_tokens += len(ids)
        body = ids[:-1] if completion.finish_reason == "stop" and ids else ids
        text = self._decode(body)
        self.messages.append({"role": "assistant", "content": text})
        return text

    def add_messages(self, messages: list[dict], *, room: int | None = None) -> bool:
        """Append messages the policy did not write, then the template's prompt for the next turn.
        False (nothing appended) when their tokens and one more to generate exceed `room`."""
        seen = self._decode(self.tokens)
        full = self._render(self.messages + messages)
        if full.startswith(seen):
            new = self._encode(full[len(seen) :])
            if room is not None and len(new) >= room:
                return False
            self.messages += messages
            self.tokens += new
            self.current.add_observed(new)
            self.response_tokens += len(new)
            return True
        self.messages += messages
        self.rewrites += 1  # the template rewrote what the model saw: a new segment from the rendering
        self.tokens = self._encode(full)
        self.segments.append(Trajectory(prompt_ids=list(self.tokens)))
        return True
