"""Running the app: `BackgroundServer`, the engine's driver on a thread and event loop of its own and
the HTTP front in a child process (serve/engine_link.py), which the trainer starts so that agents
reach the policy being trained by URL (every engine call then goes through that driver); and
`hybridflow serve MODEL`, the same in the foreground."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import Future

import uvicorn

from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.errors import UserError
from hybridflow.serve.app import create_app
from hybridflow.serve.engine_link import EngineLink, start_api_process

log = logging.getLogger(__name__)


def build_engine(model: str, *, device: str, dtype: str, max_context: int, gpu_memory_utilization: float):
    """(engine, tokenizer) of the built-in engine over our model of `model`."""
    from hybridflow.devices import resolve_device
    from hybridflow.engine import Engine, EngineConfig
    from hybridflow.engine.engine import pool_tokens_for
    from hybridflow.models import load_causal_lm
    from hybridflow.models.loading import stop_token_ids

    net, tokenizer = load_causal_lm(model, dtype=dtype, impl="native")
    where = resolve_device(device)
    net.to(where)
    cuda = where.type == "cuda"
    page_size = 64 if cuda else 16
    config = EngineConfig(
        max_context_tokens=max_context,
        page_size=page_size,
        max_batch_sequences=256 if cuda else 64,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_tokens=None if cuda else pool_tokens_for(64, max_context, page_size),
    )
    return Engine(net, eos_token_ids=stop_token_ids(net, tokenizer), config=config, device=where), tokenizer


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False
    )


def serve(engine, tokenizer, *, model_name: str, host: str, port: int, api_key: str | None = None) -> None:
    """`hybridflow serve`: the engine here, the HTTP front in its own process, until SIGINT or
    SIGTERM (then, once both have shut down, ended by that signal, as systemd and Slurm expect)."""
    server = BackgroundServer(
        engine, tokenizer, model_name=model_name, host=host, port=port, api_key=api_key, log_level="info"
    ).start(timeout_s=300)
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: caught.append(number))
    try:
        while not caught:
            if not server.thread.is_alive():
                raise UserError(f"the HTTP server on {host}:{port} ended on its own: {server.failure!r}")
            time.sleep(0.2)
    finally:
        server.stop()
    signal.signal(caught[0], signal.SIG_DFL)
    signal.raise_signal(caught[0])


class BackgroundServer:
    """The server, with the engine's driver on a thread of this process and the HTTP front in a
    process of its own (`api_process`; False: in this thread too, e.g. where no child process may
    start). `call(fn)` runs fn(engine) between two engine steps and `run(coro_fn)` runs a coroutine
    on the driver's loop, each waited for at most `timeout_s`."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        api_process: bool = True,
        log_level: str = "warning",
    ) -> None:
        self.front = AsyncEngine(engine)
        self.tokenizer, self.model_name, self.api_key = tokenizer, model_name, api_key
        self.host, self.port = host, port or _free_port(host)
        self.api_process, self.log_level = api_process, log_level
        self.server: uvicorn.Server | None = None
        if not api_process:
            app = create_app(self.front, tokenizer, model_name=model_name, api_key=api_key)
            self.server = uvicorn.Server(_config(app, self.host, self.port, log_level))
        self.link: EngineLink | None = None
        self.process = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._main, name="hybridflow-serve", daemon=True)
        self.failure: BaseException | None = None
        self._started = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _main(self) -> None:
        factory = _config(None, self.host, self.port, self.log_level).get_loop_factory()
        self.loop = factory() if factory is not None else asyncio.new_event_loop()  # uvloop where installed
        try:
            if self.api_process:
                self.loop.run_until_complete(self._link_main())
            else:
                self.loop.run_until_complete(self._in_process_main())
            self.loop.run_until_complete(self.front.aclose())
        except BaseException as e:  # a port in use, ...: start() reports it
            self.failure = e
        finally:
            self.loop.close()

    async def _in_process_main(self) -> None:
        serving = asyncio.ensure_future(self.server.serve())
        while not self.server.started and not serving.done():
            await asyncio.sleep(0.01)
        if self.server.started:
            self._started.set()
        await serving

    async def _link_main(self) -> None:
        settings = {"model_name": self.model_name, "host": self.host, "port": self.port,
                    "api_key": self.api_key, "log_level": self.log_level,
                    "max_context_tokens": self.front.max_context_tokens}  # fmt: skip
        self.process, conn = start_api_process(self.tokenizer, settings)
        self.link = EngineLink(self.front, conn, asyncio.get_running_loop())
        self.link.start()
        await self.link.ready
        self._started.set()
        await self.link.closed.wait()

    def start(self, timeout_s: float = 120.0) -> BackgroundServer:
        with socket.socket() as probe:  # a port in use, said here rather than in the child's log
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind((self.host, self.port))
            except OSError as e:
                raise UserError(
                    f"the policy server could not start on {self.host}:{self.port}: {e.strerror}"
                ) from None
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._started.wait(0.01):
            if not self.thread.is_alive():
                raise UserError(
                    f"the policy server could not start on {self.host}:{self.port}: {self.failure!r}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise UserError(
                    f"the policy server did not start on {self.host}:{self.port} within {timeout_s:.0f} s"
                )
        log.info("serving the policy at %s", self.url)
        return self

    def run(self, coro_fn, timeout_s: float):
        if not self.thread.is_alive():
            code = self.process.poll() if self.process is not None else None
            raise RuntimeError(
                f"the policy server at {self.url} has stopped (its HTTP process ended with {code}): {self.failure!r}"
            )
        future: Future = asyncio.run_coroutine_threadsafe(coro_fn(), self.loop)
        return future.result(timeout=timeout_s)

    def call(self, fn, timeout_s: float = 600.0):
        return self.run(lambda: self.front.between_steps(fn), timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the HTTP front, then the driver; a child that does not end in time is killed."""
        if self.server is not None:
            self.server.should_exit = True
        elif self.link is not None and self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self.link.stop)
        if self.process is not None:
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)
        self.thread.join(timeout_s)
