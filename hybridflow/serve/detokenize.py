"""A sample's text as its tokens arrive. A request that streams or has stop strings decodes
incrementally (each step decodes a window from the last safe point, as vLLM does: the text of the
new tokens is what decoding them after their context adds), cut at the first stop string, with a
tail held back that could still become a stop string or is half of a UTF-8 character. Any other
request decodes once, at the end: per-step decoding would compete with the engine for the GIL."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SampleText:
    tokenizer: object
    stops: list[str]
    incremental: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already streamed
    tokens_sent: int = 0
    finish_reason: str | None = None
    _prefix: int = 0  # tokens before the decoding window (context for the next piece)
    _read: int = 0  # tokens whose text is in `text`

    def __post_init__(self) -> None:
        self.incremental = self.incremental or bool(self.stops)
        self._longest_stop = max(map(len, self.stops), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        ids = self.token_ids
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(ids)

    def add(self, token_ids, logprobs, sampling_logprobs, weight_version, finish_reason) -> None:
        """Tokens of one engine step; ignored once the sample is done (a stop string was met)."""
        if self.finish_reason is not None:
            return
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.sampling_logprobs += sampling_logprobs
        self.weight_versions += [weight_version] * len(token_ids)
        if not self.incremental:
            if finish_reason is not None:
                self.text, self.finish_reason = self._decode(self.token_ids), finish_reason
            return
        searched = max(0, len(self.text) - self._longest_stop + 1)
        self._advance(final=finish_reason is not None)
        cut = min((i for i in (self.text.find(s, searched) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:  # the token that completed the stop string is kept, its text is not
            self.text, self.finish_reason = self.text[:cut], "stop"
        else:
            self.finish_reason = finish_reason

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
            held = max(
                (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0
            )
            safe -= held
        out, self.sent = self.text[self.sent : max(safe, self.sent)], max(safe, self.sent)
        return out
