"""The HTTP front in a process of its own, linked to the engine's process by a pipe.

HTTP parsing, validation, chat templates, detokenizing and JSON take ~0.7 ms of CPU per request, all
of it under the GIL that the engine's stepping thread needs too: at hundreds of clients that made the
engine wait (docs/benchmarks.md). So the server runs in a child process (`api_process_main`), and
only token ids and sampling parameters cross the pipe: `RemoteFront` there has AsyncEngine's calls
(`stream`, `engine_stats`, `error`, `max_context_tokens`); `EngineLink` here runs each request on the
engine's AsyncEngine. Messages go in batches, one per event-loop turn, written and read by threads of
their own (a slow peer never blocks a loop). Either side ending closes the pipe, and the other hears
of it: the front fails its requests and stops serving; the engine side aborts the front's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import pickle
import queue
import socket
import subprocess
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection

from hybridflow.child_process import child_link, start_child
from hybridflow.engine.requests import RequestOutput
from hybridflow.rollout.sampling import SamplingParams

STATS_TIMEOUT_S = 10.0


class _Wire:
    """One end of the pipe, used from an event loop: `send(msg)` batches the messages of one loop
    turn into one write (by a writer thread); a reader thread hands each batch that arrives to
    `on_batch` on the loop, and `on_closed` once, when the other end is gone."""

    def __init__(self, conn, loop: asyncio.AbstractEventLoop, on_batch, on_closed) -> None:
        self.conn, self.loop = conn, loop
        self.on_batch, self.on_closed = on_batch, on_closed
        self._pending: list[tuple] = []
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="hybridflow-link-read", daemon=True)
        self._writer = threading.Thread(target=self._write, name="hybridflow-link-write", daemon=True)

    def start(self) -> None:
        self._reader.start()
        self._writer.start()

    def send(self, message: tuple) -> None:
        if not self._pending:
            self.loop.call_soon(self._flush)
        self._pending.append(message)

    def _flush(self) -> None:
        batch, self._pending = self._pending, []
        self._outbox.put(batch)

    def _write(self) -> None:
        while (batch := self._outbox.get()) is not None:
            try:
                self.conn.send(batch)
            except (OSError, ValueError):  # the other end is gone: the reader reports it
                return

    def _read(self) -> None:
        while True:
            try:
                batch = self.conn.recv()
            except (EOFError, OSError) as e:
                self._call(self.on_closed, e)
                return
            self._call(self.on_batch, batch)

    def _call(self, fn, arg) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is left to tell
            self.loop.call_soon_threadsafe(fn, arg)

    def close(self) -> None:
        """Flush what is pending, then stop writing."""
        if self._pending:
            self._flush()
        self._outbox.put(None)


def _portable(error: BaseException) -> BaseException:
    """The error itself if it pickles (UserError does), else a RuntimeError naming it."""
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return RuntimeError(repr(error))


class _Failed:
    def __init__(self, error: BaseException, fatal: bool) -> None:
        self.error, self.fatal = error, fatal


class RemoteFront:
    """The API process's view of the engine: AsyncEngine's calls, over the pipe."""

    def __init__(self, conn, max_context_tokens: int, id_prefix: str = "http-") -> None:
        self.conn, self.max_context_tokens, self.id_prefix = conn, max_context_tokens, id_prefix
        self.error: BaseException | None = None
        self._streams: dict[str, tuple[asyncio.Queue, Callable | None]] = {}
        self._stats: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._wire: _Wire | None = None
        self._on_stop: Callable[[], None] = lambda: None

    def start(self, loop: asyncio.AbstractEventLoop, on_stop: Callable[[], None]) -> None:
        """Begin reading; `on_stop()` when the engine side asks the server to end or goes away."""
        self._on_stop = on_stop
        self._wire = _Wire(self.conn, loop, self._on_batch, self._on_closed)
        self._wire.start()

    def send(self, message: tuple) -> None:
        self._wire.send(message)

    async def stream(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        every_step: bool = True,
        on_first_output=None,
    ) -> AsyncIterator[RequestOutput]:
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}")
        request_id = request_id if request_id is not None else f"{self.id_prefix}{next(self._ids)}"
        inbox: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (inbox, on_first_output)
        self.send(("add", request_id, list(prompt_ids), params, every_step))
        left = params.n
        try:
            while left:
                out = await inbox.get()
                if isinstance(out, _Failed):
                    if out.fatal:
                        raise RuntimeError(f"the engine stopped: {out.error!r}") from out.error
                    raise out.error
                left -= out.finished
                yield out
        finally:
            self._streams.pop(request_id, None)
            if left and self.error is None:  # cancelled, or the reader stopped: the engine aborts it
                self.send(("abort", request_id))

    async def engine_stats(self) -> dict[str, int]:
        if self.error is not None:
            raise RuntimeError(f"the engine stopped: {self.error!r}")
        token = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._stats[token] = future
        self.send(("stats", token))
        try:
            return await asyncio.wait_for(future, STATS_TIMEOUT_S)
        finally:
            self._stats.pop(token, None)

    def _on_batch(self, batch: list[tuple]) -> None:
        for message in batch:
            kind = message[0]
            if kind == "out":
                if (entry := self._streams.get(message[1])) is not None:
                    entry[0].put_nowait(message[2])
            elif kind == "first":
                entry = self._streams.get(message[1])
                if entry is not None and entry[1] is not None:
                    entry[1]()
            elif kind == "fail":
                if message[3] and self.error is None:  # the engine itself stopped: /health says so
                    self.error = message[2]
                if (entry := self._streams.get(message[1])) is not None:
                    entry[0].put_nowait(_Failed(message[2], fatal=message[3]))
            elif kind == "stats":
                future = self._stats.get(message[1])
                if future is not None and not future.done():
                    future.set_result(message[2])
            elif kind == "stop":
                self._on_stop()

    def _on_closed(self, error: BaseException) -> None:
        self.error = ConnectionError("the engine's process closed the link")
        for inbox, _ in self._streams.values():
            inbox.put_nowait(_Failed(self.error, fatal=True))
        for future in self._stats.values():
            if not future.done():
                future.set_exception(RuntimeError(f"the engine stopped: {self.error!r}"))
        self._on_stop()

    def close(self) -> None:
        if self._wire is not None:
            self._wire.close()


class EngineLink:
    """The engine process's end: the API process's requests, run on `front` (an AsyncEngine)."""

    def __init__(self, front, conn, loop: asyncio.AbstractEventLoop) -> None:
        self.front = front
        self.ready: asyncio.Future = loop.create_future()  # the API process is serving (or failed to)
        self.closed = asyncio.Event()
        self._tasks: dict[str, asyncio.Task] = {}
        self._loop = loop
        self._wire = _Wire(conn, loop, self._on_batch, self._on_closed)

    def start(self) -> None:
        self._wire.start()

    def stop(self) -> None:
        """Ask the API process to end; `closed` is set when it has."""
        self._wire.send(("stop",))

    def _on_batch(self, batch: list[tuple]) -> None:
        for message in batch:
            kind = message[0]
            if kind == "add":
                _, request_id, prompt_ids, params, every_step = message
                self._tasks[request_id] = self._loop.create_task(
                    self._run(request_id, prompt_ids, params, every_step)
                )
            elif kind == "abort":
                if (task := self._tasks.get(message[1])) is not None:
                    task.cancel()
            elif kind == "stats":
                self._wire.send(("stats", message[1], self.front.engine.serving_stats()))
            elif kind == "ready" and not self.ready.done():
                self.ready.set_result(None)
            elif kind == "failed" and not self.ready.done():
                self.ready.set_exception(RuntimeError(message[1]))

    async def _run(self, request_id: str, prompt_ids, params, every_step: bool) -> None:
        send = self._wire.send
        try:
            async for out in self.front.stream(
                prompt_ids,
                params,
                request_id,
                every_step=every_step,
                on_first_output=lambda: send(("first", request_id)),
            ):
                send(("out", request_id, out))
        except asyncio.CancelledError:
            pass  # the client went away: the stream has aborted the request
        except Exception as e:  # a refused prompt, or the engine failed
            send(("fail", request_id, _portable(e), self.front.error is not None))
        finally:
            self._tasks.pop(request_id, None)

    def _on_closed(self, error: BaseException) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(f"the HTTP process ended before serving ({error!r})"))
        self._wire.close()
        self.closed.set()


def start_api_process(
    tokenizer, settings: dict, listener: socket.socket | None, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen, Connection]:
    """The HTTP front as `python -m hybridflow.serve.engine_link FD` (child_process.start_child: the
    caller's main script is not imported again there). The tokenizer and the settings are the link's
    first message; `listener`, a socket bound here, is accepted on by every front process (the kernel
    spreads the connections), else the child binds host:port itself."""
    settings = settings | {"listener_fd": listener.fileno() if listener is not None else None}
    return start_child(
        "hybridflow.serve.engine_link", (tokenizer, settings), env_extra=env_extra,
        pass_fds=(listener.fileno(),) if listener is not None else (),
    )  # fmt: skip


def api_process_main(conn, tokenizer, settings: dict) -> None:
    """The child process: uvicorn over `create_app(RemoteFront)`, until the engine side says stop or
    goes away (or a signal ends it). Reports "ready", or "failed" with the reason."""
    import uvicorn

    from hybridflow.serve.app import create_app
    from hybridflow.serve.http_protocol import with_read_timeout

    front = RemoteFront(conn, settings["max_context_tokens"], settings["id_prefix"])
    app = create_app(front, tokenizer, model_name=settings["model_name"], api_key=settings["api_key"])
    config = uvicorn.Config(
        app,
        host=settings["host"],
        port=settings["port"],
        log_level=settings["log_level"],
        timeout_graceful_shutdown=5,
        access_log=False,
        http=with_read_timeout(settings["read_timeout_s"]),  # a request that arrives too slowly is cut off
    )
    server = uvicorn.Server(config)

    def stop() -> None:
        server.should_exit = True

    async def main() -> None:
        front.start(asyncio.get_running_loop(), on_stop=stop)
        fd = settings["listener_fd"]
        sockets = [socket.socket(fileno=fd)] if fd is not None else None
        serving = asyncio.ensure_future(server.serve(sockets=sockets))
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        if serving.done():
            reason = serving.exception() if not serving.cancelled() else None
            front.send(("failed", f"could not serve on {settings['host']}:{settings['port']}: {reason!r}"))
        else:
            front.send(("ready",))
        try:
            await serving
        finally:
            front.close()

    factory = config.get_loop_factory()  # uvloop where installed
    loop = factory() if factory is not None else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


if __name__ == "__main__":
    link = child_link()
    api_process_main(link, *link.recv())
