"""Running the app: `BackgroundServer`, the engine's driver on a thread and event loop of its own and
the HTTP front in a child process (serve/engine_link.py), which the trainer starts so that agents
reach the policy being trained by URL (every engine call then goes through that driver); and
`hybridflow serve MODEL`, the same in the foreground."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import Future

import uvicorn

from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.errors import UserError
from hybridflow.serve.app import create_app
from hybridflow.serve.engine_link import EngineLink, start_api_process
from hybridflow.serve.http_protocol import REQUEST_READ_TIMEOUT_S, with_read_timeout

log = logging.getLogger(__name__)


def build_engine(model: str, *, device: str, dtype: str, max_context: int, gpu_memory_utilization: float):
    """(engine, tokenizer) of the built-in engine over our model of `model`."""
    from hybridflow.devices import resolve_device
    from hybridflow.engine import EngineConfig, build_engine
    from hybridflow.models import load_causal_lm
    from hybridflow.models.loading import stop_token_ids

    net, tokenizer = load_causal_lm(model, dtype=dtype, impl="native")
    where = resolve_device(device)
    net.to(where)
    cuda = where.type == "cuda"
    config = EngineConfig(
        max_context_tokens=max_context,
        max_batch_sequences=256 if cuda else 64,
        gpu_memory_utilization=gpu_memory_utilization,
    )
    engine = build_engine(
        net, eos_token_ids=stop_token_ids(net, tokenizer), device=where, config=config, sequences=64
    )
    return engine, tokenizer


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _config(
    app, host: str, port: int, log_level: str, read_timeout_s: float = REQUEST_READ_TIMEOUT_S
) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False,
        http=with_read_timeout(read_timeout_s),  # a request that arrives too slowly is cut off (slow loris)
    )  # fmt: skip


def serve(
    engine,
    tokenizer,
    *,
    model_name: str,
    host: str,
    port: int,
    api_key: str | None = None,
    api_processes: int = 1,
) -> None:
    """`hybridflow serve`: the engine here, the HTTP front in its own process, until SIGINT or
    SIGTERM (then, once both have shut down, ended by that signal, as systemd and Slurm expect)."""
    server = BackgroundServer(
        engine, tokenizer, model_name=model_name, host=host, port=port, api_key=api_key,
        api_processes=api_processes, log_level="info",
    ).start(timeout_s=300)  # fmt: skip
    caught: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda number, frame: caught.append(number))
    try:
        watch(server, until=lambda: bool(caught))
    finally:
        server.stop()
    signal.signal(caught[0], signal.SIG_DFL)
    signal.raise_signal(caught[0])


def watch(server: BackgroundServer, until, poll_s: float = 0.2) -> None:
    """Return once `until()` holds; raise UserError when the server cannot go on: its HTTP side
    ended, or its engine stopped (every later request would fail: the process ends, so that a
    supervisor restarts it, rather than answer 503 for ever)."""
    while not until():
        if not server.thread.is_alive():
            raise UserError(f"the HTTP server at {server.url} ended on its own: {server.failure!r}")
        if server.front.error is not None:
            raise UserError(f"the engine stopped ({server.front.error!r}); the server ends")
        time.sleep(poll_s)


def _exit_code(process: subprocess.Popen) -> int | None:
    """Its exit code; a process whose end closed the link may take a moment to be reapable."""
    try:
        return process.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return None


class BackgroundServer:
    """The server: the engine's driver on a thread of this process, the HTTP front in
    `api_processes` processes of their own accepting on one socket (HTTP, validation and JSON cost
    ~0.7 ms of CPU a request: in parallel, and away from the engine's GIL), or with
    `api_process=False` on the driver's thread too. `call(fn)` runs fn(engine) between two engine
    steps and `run(coro_fn)` runs a coroutine on the driver's loop, each waited for at most
    `timeout_s`."""

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
        api_processes: int = 1,
        log_level: str = "warning",
        request_read_timeout_s: float = REQUEST_READ_TIMEOUT_S,
    ) -> None:
        """`request_read_timeout_s`: a request must arrive whole within it (slow loris)."""
        if api_processes < 1:
            raise UserError(f"api_processes={api_processes}: give at least 1")
        self.front = AsyncEngine(engine)
        self.tokenizer, self.model_name, self.api_key = tokenizer, model_name, api_key
        self.host, self.port = host, port or _free_port(host)
        self.api_process, self.log_level = api_process, log_level
        self.request_read_timeout_s = request_read_timeout_s
        self.api_processes = api_processes if api_process else 0
        self.server: uvicorn.Server | None = None
        if not api_process:
            app = create_app(self.front, tokenizer, model_name=model_name, api_key=api_key)
            self.server = uvicorn.Server(
                _config(app, self.host, self.port, log_level, request_read_timeout_s)
            )
        self.links: list[EngineLink] = []
        self.processes: list[subprocess.Popen] = []
        self._listener: socket.socket | None = None
        self._metrics_dir: str | None = None
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
        """Start the front processes, link each, serve until they have all ended."""
        loop = asyncio.get_running_loop()
        env = {}
        if self.api_processes > 1:  # their metrics, summed at each scrape
            self._metrics_dir = tempfile.mkdtemp(prefix="hybridflow-metrics-")
            env["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir
        for i in range(self.api_processes):
            settings = {"model_name": self.model_name, "host": self.host, "port": self.port,
                        "api_key": self.api_key, "log_level": self.log_level, "id_prefix": f"http{i}-",
                        "max_context_tokens": self.front.max_context_tokens,
                        "read_timeout_s": self.request_read_timeout_s}  # fmt: skip
            process, conn = start_api_process(self.tokenizer, settings, self._listener, env)
            link = EngineLink(self.front, conn, loop)
            link.start()
            self.processes.append(process)
            self.links.append(link)
        self._listener.close()  # the children hold it: a port no process serves is not left bound
        try:
            await asyncio.gather(*(link.ready for link in self.links))
        finally:
            for link in self.links:  # one that failed: the others end too
                if not link.ready.done() or link.ready.exception() is not None:
                    for other in self.links:
                        other.stop()
                    break
        self._started.set()
        await asyncio.wait([asyncio.ensure_future(link.closed.wait()) for link in self.links],
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        for link in self.links:  # one front gone (killed, crashed): the server is down
            link.stop()
        await asyncio.gather(*(link.closed.wait() for link in self.links))

    def start(self, timeout_s: float = 120.0) -> BackgroundServer:
        try:
            if self.api_process:  # bound here, accepted on by the front processes
                self._listener = socket.create_server((self.host, self.port), backlog=4096)
            else:  # a port in use, said here rather than in uvicorn's log
                with socket.create_server((self.host, self.port)):
                    pass
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
            codes = [_exit_code(p) for p in self.processes]
            raise RuntimeError(
                f"the policy server at {self.url} has stopped (its HTTP processes ended with {codes}): {self.failure!r}"
            )
        future: Future = asyncio.run_coroutine_threadsafe(coro_fn(), self.loop)
        return future.result(timeout=timeout_s)

    def call(self, fn, timeout_s: float = 600.0):
        return self.run(lambda: self.front.between_steps(fn), timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the HTTP front, then the driver; a child that does not end in time is killed."""
        if self.server is not None:
            self.server.should_exit = True
        elif self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                for link in self.links:
                    self.loop.call_soon_threadsafe(link.stop)
        for process in self.processes:
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout_s)
        if self._listener is not None:
            self._listener.close()
        self.thread.join(timeout_s)
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
