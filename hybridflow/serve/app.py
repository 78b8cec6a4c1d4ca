"""The OpenAI-compatible routes over one AsyncEngine: /v1/chat/completions, /v1/completions (both
streaming or not, with log-probs and, on request, token ids), /v1/models, /metrics, /health.

Errors are OpenAI's shape with one line naming the problem: 400 for a body we cannot honour, 404 for
another model's name. A client that goes away stops its request (its pages are freed)."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import time
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridflow.engine.async_engine import AsyncEngine
from hybridflow.errors import UserError
from hybridflow.serve.detokenize import SampleText
from hybridflow.serve.engine_link import RemoteFront
from hybridflow.serve.metrics import ServerMetrics
from hybridflow.serve.protocol import ChatCompletionRequest, CompletionRequest, Unsupported
from hybridflow.serve.rendering import render_chat
from hybridflow.serve.tool_calls import parse_tool_calls, tool_format

_ids = random.Random()
MAX_SAMPLES_PER_REQUEST = 256  # prompts x n of one request (n alone is capped at 256 too, as vLLM's)
DISCONNECT_POLL_S = 1.0  # each check costs the event loop (and the engine's thread, the GIL) a little
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class ClientGone(Exception):
    """The client disconnected before its completion was ready: its request was stopped."""


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def create_app(
    front: AsyncEngine | RemoteFront,
    tokenizer,
    *,
    model_name: str,
    metrics: ServerMetrics | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """`front`: the engine in this process (AsyncEngine) or in another (RemoteFront), the same calls.
    `api_key`: the /v1 routes then want `Authorization: Bearer <api_key>` (what the openai client sends)."""
    max_context = front.max_context_tokens
    latest: dict = {}  # the engine's state, fetched before each scrape (it may live in another process)
    metrics = metrics or ServerMetrics(lambda: latest)
    fmt = tool_format(tokenizer.chat_template)
    vocab = len(tokenizer)  # a fast tokenizer counts its added tokens at every len()
    app = FastAPI(title="hybridflow", docs_url=None, redoc_url=None)
    app.state.metrics = metrics

    async def authorized(request: Request) -> None:  # a dependency, not a middleware: Starlette's
        # BaseHTTPMiddleware hides a client's disconnect from the endpoint; async: FastAPI runs a
        # plain function in a worker thread
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise BadRequest("a valid API key is needed: Authorization: Bearer <key>", status=401)

    auth = [Depends(authorized)]  # the /v1 routes; /health and /metrics stay open to probes

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid body"}
        loc = [x for x in first.get("loc", ()) if x != "body"]
        message = first.get("msg")
        union = next(
            (i for i, x in enumerate(loc) if isinstance(x, str) and x in _TYPE_TAGS or "[" in str(x)), None
        )
        if union is not None:  # pydantic names the union member that failed last: name the field
            loc, message = loc[:union], "is not of an accepted type (see the OpenAI API reference)"
        where = ".".join(str(x) for x in loc)
        if first.get("type") == "json_invalid":
            where, message = "", "the body is not valid JSON"
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, f"{where or 'body'}: {message}", where or None)

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, exc: BadRequest):
        metrics.requests.labels(request.url.path, str(exc.status)).inc()
        return _error(exc.status, str(exc), exc.param)

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)  # nobody reads it: nginx's code for a client that left

    @app.exception_handler(UserError)
    async def _refused_by_engine(request: Request, exc: UserError):  # the request alone failed
        metrics.requests.labels(request.url.path, "400").inc()
        return _error(400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method, ...
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(RuntimeError)
    async def _engine_failed(request: Request, exc: RuntimeError):
        metrics.requests.labels(request.url.path, "503").inc()
        return _error(503, str(exc).splitlines()[0] if str(exc) else repr(exc))

    @app.get("/health")
    async def health():
        if front.error is not None:
            return _error(503, f"the engine stopped: {front.error!r}")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        latest.update(await front.engine_stats())
        return Response(generate_latest(metrics.exposition), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "hybridflow",
            "max_model_len": max_context,
        }
        return {"object": "list", "data": [card]}

    def check(body, prompt_ids: list[int]) -> int:
        """The request's max_tokens, once the body and the prompt are known to be servable."""
        if body.model != model_name:
            raise BadRequest(
                f"the model `{body.model}` does not exist; this server serves `{model_name}`", "model", 404
            )
        try:
            body.check()
        except Unsupported as e:
            raise BadRequest(str(e), e.param) from None
        if any(not 0 <= t < vocab for t in body.stop_token_ids):
            raise BadRequest(
                f"stop_token_ids: a token id is outside the vocabulary of {vocab}", "stop_token_ids"
            )
        if not prompt_ids or len(prompt_ids) >= max_context:
            raise BadRequest(
                f"the prompt has {len(prompt_ids)} tokens; this server takes 1 to {max_context - 1} (its context is {max_context})",
                "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
            )
        room = max_context - len(prompt_ids)
        if body.limit is not None and body.limit > room:
            raise BadRequest(
                f"max_tokens={body.limit} with a prompt of {len(prompt_ids)} tokens exceeds the context of {max_context}",
                "max_tokens",
            )
        return body.limit or room

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatCompletionRequest, request: Request):
        if body.tools and body.tool_choice != "none" and fmt is None:
            raise BadRequest("this model's chat template does not render tools", "tools")
        try:
            prompt_ids = render_chat(tokenizer, body)
        except UserError as e:
            raise BadRequest(str(e), "messages") from None
        max_tokens = check(body, prompt_ids)
        calls = fmt if body.tools and body.tool_choice != "none" else None
        run = _Run(front, tokenizer, metrics, body, prompt_ids, max_tokens, "/v1/chat/completions")
        if body.stream:
            return StreamingResponse(run.chat_stream(calls), media_type="text/event-stream")
        await run.until_done_or_gone(request)
        return JSONResponse(run.chat_response(calls))  # plain JSON: FastAPI's encoder walks every id

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request):
        try:
            prompts = [
                tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else list(p)
                for p in body.prompts
            ]
        except (TypeError, ValueError) as e:
            raise BadRequest(f"prompt: {e}", "prompt") from None
        if len(prompts) * body.n > MAX_SAMPLES_PER_REQUEST:
            raise BadRequest(
                f"prompt: {len(prompts)} prompts x n={body.n} is {len(prompts) * body.n} samples; one request "
                f"takes at most {MAX_SAMPLES_PER_REQUEST} (send several requests: they are served side by side)",
                "prompt",
            )
        for ids in prompts:
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise BadRequest(f"prompt: a token id is outside the vocabulary of {vocab}", "prompt")
        max_tokens = [check(body, ids) for ids in prompts]
        runs = [
            _Run(front, tokenizer, metrics, body, ids, m, "/v1/completions")
            for ids, m in zip(prompts, max_tokens)
        ]
        if body.stream:
            return StreamingResponse(_completion_stream(runs, body), media_type="text/event-stream")
        await asyncio.gather(*(run.until_done_or_gone(request) for run in runs))
        return JSONResponse(_completion_response(runs, body))

    return app


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Run:
    """One prompt's samples, fed by the engine's stream."""

    def __init__(self, front, tokenizer, metrics, body, prompt_ids, max_tokens, endpoint) -> None:
        self.front, self.tokenizer, self.metrics, self.body = front, tokenizer, metrics, body
        self.prompt_ids, self.endpoint = prompt_ids, endpoint
        self.params = body.sampling(max_tokens)
        stops = body.stop_strings
        self.samples = [SampleText(tokenizer, stops, incremental=body.stream) for _ in range(body.n)]
        kind = "chatcmpl" if endpoint.endswith("chat/completions") else "cmpl"
        self.id = f"{kind}-{_ids.getrandbits(96):024x}"  # an id, not a secret: no system call per request
        self.created = int(time.time())
        self.start = time.perf_counter()
        self.model = body.model

    async def steps(self):
        """Yield after each engine step that advanced a sample; stops the request once every sample
        is done (a stop string can end a sample before the engine does)."""
        m = self.metrics
        m.prompt_tokens.inc(len(self.prompt_ids))
        finished = False
        # a reply returned whole, with no stop strings, is woken once per sample, not at every step
        every_step = self.body.stream or any(s.incremental for s in self.samples)
        stream = self.front.stream(
            self.prompt_ids, self.params, every_step=every_step, on_first_output=self._first_output
        )
        try:
            async for out in stream:
                m.generation_tokens.inc(len(out.token_ids))
                self.samples[out.sample].add(
                    out.token_ids, out.unscaled_logprobs, out.logprobs, out.weight_version, out.finish_reason
                )
                yield out.sample
                if all(s.done for s in self.samples):
                    break
            finished = True
        finally:
            await stream.aclose()  # stops what is still running (a stop string, or the client left)
            if not finished:
                m.aborted.inc()
            m.latency.labels(self.endpoint).observe(time.perf_counter() - self.start)
            m.requests.labels(self.endpoint, "200" if finished else "499").inc()

    def _first_output(self) -> None:
        self.metrics.first_token.observe(time.perf_counter() - self.start)

    async def until_done_or_gone(self, request: Request) -> None:
        """Run to the end, or stop when the client has gone (checked every DISCONNECT_POLL_S)."""

        async def consume() -> None:
            async for _ in self.steps():
                pass

        work = asyncio.ensure_future(consume())
        try:
            while True:
                done, _ = await asyncio.wait([work], timeout=DISCONNECT_POLL_S)
                if done:
                    return work.result()
                if await request.is_disconnected():
                    raise ClientGone
        finally:
            work.cancel()

    # ---- chat ---------------------------------------------------------------------------------
    def _logprobs(self, s: SampleText, start: int = 0, end: int | None = None) -> dict:
        entries = []
        for t, lp, slp in zip(s.token_ids[start:end], s.logprobs[start:end], s.sampling_logprobs[start:end]):
            text = self.tokenizer.decode([t])
            entries.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [],
                    "sampling_logprob": slp,
                }
            )
        return {"content": entries}

    def _usage(self) -> dict:
        completion = sum(len(s.token_ids) for s in self.samples)
        prompt = len(self.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _extras(self, s: SampleText) -> dict:
        return (
            {"token_ids": s.token_ids, "weight_versions": s.weight_versions}
            if self.body.return_token_ids
            else {}
        )

    def chat_response(self, calls: str | None) -> dict:
        choices = []
        for i, s in enumerate(self.samples):
            content, tool_calls = parse_tool_calls(s.text, calls) if calls else (s.text, [])
            message = {"role": "assistant", "content": content}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": self._logprobs(s) if self.body.logprobs else None,
                    "finish_reason": "tool_calls" if tool_calls else s.finish_reason,
                    **self._extras(s),
                }
            )
        out = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
               "choices": choices, "usage": self._usage()}  # fmt: skip
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def _chunk(self, choices: list[dict], **extra) -> str:
        return _sse({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                     "model": self.model, "choices": choices, **extra})  # fmt: skip

    async def chat_stream(self, calls: str | None):
        first = {"prompt_token_ids": self.prompt_ids} if self.body.return_token_ids else {}
        yield self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(self.body.n)], **first)  # fmt: skip
        streamed = [0] * self.body.n  # tokens already sent per sample
        async for i in self.steps():
            s = self.samples[i]
            if calls and not s.done:
                continue  # tool calls are parsed once the sample is complete
            if calls:
                content, tool_calls = parse_tool_calls(s.text, calls)
                delta: dict = {"content": content} if content else {}
                if tool_calls:
                    delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(tool_calls)]
            else:
                text = s.delta()
                tool_calls, delta = [], {"content": text} if text else {}
            choice = {"index": i, "delta": delta, "finish_reason": None, "logprobs": None}
            if self.body.logprobs:
                choice["logprobs"] = self._logprobs(s, streamed[i])
            if self.body.return_token_ids:
                choice["token_ids"] = s.new_tokens()
            streamed[i] = len(s.token_ids)
            if s.done:
                choice["finish_reason"] = "tool_calls" if tool_calls else s.finish_reason
            if delta or choice["finish_reason"] or choice.get("token_ids"):
                yield self._chunk([choice])
        if self.body.include_usage:
            yield self._chunk([], usage=self._usage())
        yield "data: [DONE]\n\n"


def _completion_choices(runs: list[_Run], body: CompletionRequest) -> list[dict]:
    choices = []
    for r, run in enumerate(runs):
        for j, s in enumerate(run.samples):
            choice = {
                "index": r * body.n + j,
                "text": s.text,
                "finish_reason": s.finish_reason,
                "logprobs": None,
            }
            if body.logprobs is not None:
                tokens = [run.tokenizer.decode([t]) for t in s.token_ids]
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": s.logprobs, "top_logprobs": None,
                                      "text_offset": None, "sampling_logprobs": s.sampling_logprobs}  # fmt: skip
            if body.return_token_ids:
                choice |= {"prompt_token_ids": run.prompt_ids, **run._extras(s)}
            choices.append(choice)
    return choices


def _completion_response(runs: list[_Run], body: CompletionRequest) -> dict:
    usage = [run._usage() for run in runs]
    total = {k: sum(u[k] for u in usage) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"id": runs[0].id, "object": "text_completion", "created": runs[0].created, "model": body.model,
            "choices": _completion_choices(runs, body), "usage": total}  # fmt: skip


async def _completion_stream(runs: list[_Run], body: CompletionRequest):
    queue: asyncio.Queue = asyncio.Queue()

    async def feed(r: int, run: _Run) -> None:
        try:
            async for i in run.steps():
                queue.put_nowait((r, i))
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.ensure_future(feed(r, run)) for r, run in enumerate(runs)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
                continue
            r, i = item
            run, s = runs[r], runs[r].samples[item[1]]
            choice = {
                "index": r * body.n + i,
                "text": s.delta(),
                "finish_reason": s.finish_reason,
                "logprobs": None,
            }
            if body.return_token_ids:
                choice["token_ids"] = s.new_tokens()
            yield _sse({"id": runs[0].id, "object": "text_completion", "created": run.created, "model": body.model,
                        "choices": [choice]})  # fmt: skip
        for t in tasks:
            await t  # a failed engine raises here
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
