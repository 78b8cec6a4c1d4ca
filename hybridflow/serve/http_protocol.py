"""uvicorn's HTTP protocol (httptools) with a deadline for reading each request. uvicorn times out
idle keep-alive connections but not a request that arrives slowly: a client that sends its headers
or body a byte at a time (slow loris) would hold its connection, and a file descriptor, for ever.
Here each request must have arrived whole within `read_timeout_s` of its first byte (of the
connection, for the first request); otherwise the connection is closed. Given to uvicorn through its
documented `http=` setting (a protocol class), not patched into it."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

REQUEST_READ_TIMEOUT_S = 30.0


class DeadlineHttpProtocol(HttpToolsProtocol):
    read_timeout_s = REQUEST_READ_TIMEOUT_S
    _read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._read_deadline is None:  # the next request on a kept-alive connection
            self._arm()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.read_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _too_slow(self) -> None:
        self._read_deadline = None
        self.logger.info(
            "closing a connection whose request did not arrive within %.0f s", self.read_timeout_s
        )
        self.transport.close()


def with_read_timeout(seconds: float) -> type[DeadlineHttpProtocol]:
    """The protocol class with another deadline (a test's short one)."""
    if seconds == REQUEST_READ_TIMEOUT_S:
        return DeadlineHttpProtocol
    return type("DeadlineHttpProtocol", (DeadlineHttpProtocol,), {"read_timeout_s": seconds})
