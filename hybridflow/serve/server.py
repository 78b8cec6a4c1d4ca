"""Running the app: `hybridflow serve MODEL` (uvicorn in the foreground), and `BackgroundServer`, the
same server on its own thread and event loop, which the trainer starts so that agents reach the
policy being trained by URL (every engine call then goes through the server's driver)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from concurrent.futures import Future

import uvicorn

from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.errors import UserError
from hybridflow.serve.app import create_app

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
    front = AsyncEngine(engine)
    app = create_app(front, tokenizer, model_name=model_name, api_key=api_key)
    server = uvicorn.Server(_config(app, host, port, "info"))
    server.run()


class BackgroundServer:
    """The server on a thread of its own. `call(fn)` runs fn(engine) between two engine steps and
    `run(coro_fn)` runs a coroutine on the server's loop, each waited for at most `timeout_s`."""

    def __init__(
        self,
        engine,
        tokenizer,
        *,
        model_name: str,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        self.front = AsyncEngine(engine)
        self.app = create_app(self.front, tokenizer, model_name=model_name, api_key=api_key)
        self.host, self.port = host, port or _free_port(host)
        self.server = uvicorn.Server(_config(self.app, self.host, self.port, "warning"))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._main, name="hybridflow-serve", daemon=True)
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _main(self) -> None:
        factory = self.server.config.get_loop_factory()  # uvloop where installed, as `serve` gets
        self.loop = factory() if factory is not None else asyncio.new_event_loop()
        try:
            self.loop.run_until_complete(self.server.serve())
            self.loop.run_until_complete(self.front.aclose())
        except BaseException as e:  # a port in use, ...: start() reports it
            self._failure = e
        finally:
            self.loop.close()

    def start(self, timeout_s: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise UserError(
                    f"the policy server could not start on {self.host}:{self.port}: {self._failure!r}"
                )
            if time.monotonic() > deadline:
                raise UserError(
                    f"the policy server did not start on {self.host}:{self.port} within {timeout_s:.0f} s"
                )
            time.sleep(0.01)
        log.info("serving the policy at %s", self.url)
        return self

    def run(self, coro_fn, timeout_s: float):
        future: Future = asyncio.run_coroutine_threadsafe(coro_fn(), self.loop)
        return future.result(timeout=timeout_s)

    def call(self, fn, timeout_s: float = 600.0):
        return self.run(lambda: self.front.between_steps(fn), timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
