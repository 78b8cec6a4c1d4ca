"""A sample's text as its tokens arrive: decoded whole each time (exact for every tokenizer; a
completion is short next to the model's work), cut at the first stop string, and with a tail held
back that could still become a stop string or is half of a UTF-8 character."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampleText:
    tokenizer: object
    stops: list[str]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    tokens_sent: int = 0
    finish_reason: str | None = None

    def add(self, token_ids, logprobs, sampling_logprobs, weight_version, finish_reason) -> None:
        """Tokens of one engine step; ignored once the sample is done (a stop string was met)."""
        if self.finish_reason is not None:
            return
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.sampling_logprobs += sampling_logprobs
        self.weight_versions += [weight_version] * len(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:  # the token that completed the stop string is kept, its text is not
            self.text, self.finish_reason = text[:cut], "stop"
        else:
            self.text, self.finish_reason = text, finish_reason

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def new_tokens(self) -> list[int]:
        """Token ids not streamed yet."""
        out, self.tokens_sent = self.token_ids[self.tokens_sent :], len(self.token_ids)
        return out

    def delta(self) -> str:
        """The text not streamed yet that can no longer change."""
        safe = len(self.text)
        if not self.done:
            if self.text.endswith("\ufffd"):
                safe -= 1
            held = max(
                (k for s in self.stops for k in range(1, len(s)) if self.text[:safe].endswith(s[:k])),
                default=0,
            )
            safe -= held
        out, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return out
