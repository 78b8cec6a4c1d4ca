"""`hybridflow serve`: the OpenAI-compatible server, talked to by the official `openai` client and a
plain `httpx` stream, on localhost. What it samples is what the engine samples in-process."""

import asyncio
import json
import os
import time

import httpx
import openai
import pytest

from hybridflow.engine import Engine, EngineConfig
from hybridflow.errors import UserError
from hybridflow.models import byte_tokenizer, tiny_model
from hybridflow.models.native import from_hf_model
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.serve.server import BackgroundServer
from hybridflow.serve.tool_calls import parse_tool_calls, tool_format

NAME = "tiny"
CONTEXT = 512


def make_engine():
    model = from_hf_model(tiny_model("qwen2", seed=3, vocab_size=260))
    config = EngineConfig(
        page_size=16, max_context_tokens=CONTEXT, max_batch_sequences=64, kv_cache_tokens=64 * CONTEXT
    )
    return Engine(model, eos_token_ids=[byte_tokenizer().eos_token_id], config=config)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="module", params=["api-process", "in-process"])
def server(tokenizer, request):
    """The HTTP front in its own process (the default), and in the engine's thread."""
    server = BackgroundServer(
        make_engine(), tokenizer, model_name=NAME, api_process=request.param == "api-process"
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def reference():
    return make_engine()


def chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def test_a_chat_completion_with_logprobs_and_token_ids_is_what_the_engine_samples(
    client, tokenizer, reference
):
    out = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=20, temperature=1.0, seed=7, logprobs=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    body = out.model_dump()
    prompt_ids = chat_ids(tokenizer, MESSAGES)
    assert body["prompt_token_ids"] == prompt_ids
    [want] = reference.generate([prompt_ids], SamplingParams(n=1, temperature=1.0, max_tokens=20, seed=7))
    choice = body["choices"][0]
    assert choice["token_ids"] == want.token_ids
    assert choice["message"]["content"] == tokenizer.decode(want.token_ids, skip_special_tokens=True)
    assert choice["finish_reason"] == want.finish_reason
    entries = choice["logprobs"]["content"]
    assert [e["logprob"] for e in entries] == pytest.approx(want.unscaled_logprobs, abs=1e-5)
    assert [e["sampling_logprob"] for e in entries] == pytest.approx(want.logprobs, abs=1e-5)
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == len(want.token_ids)
    assert choice["weight_versions"] == [0] * len(want.token_ids)


def test_streamed_deltas_join_to_the_whole_completion(client):
    args = {"model": NAME, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_from_text_and_token_ids_with_n_samples(client, tokenizer, reference):
    ids = [[40, 41, 42, 43, 44], [50, 51]]
    texts = ["hello", "a b c"]
    for prompt, prompt_ids in ((ids, ids), (texts, [tokenizer(t)["input_ids"] for t in texts])):
        out = client.completions.create(
            model=NAME, prompt=prompt, n=2, max_tokens=12, temperature=0.8, seed=3,
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        for r, p in enumerate(prompt_ids):
            want = reference.generate([p], SamplingParams(n=2, temperature=0.8, max_tokens=12, seed=3))
            got = [c.model_dump() for c in out.choices[2 * r : 2 * r + 2]]
            assert [c["token_ids"] for c in got] == [g.token_ids for g in want]
            assert [c["text"] for c in got] == [
                tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in want
            ]
            assert all(c["prompt_token_ids"] == p for c in got)
    with pytest.raises(openai.BadRequestError, match="prompt: is not of an accepted type"):
        client.completions.create(model=NAME, prompt=[ids[0], "mixed"], max_tokens=4)


def test_sixty_four_concurrent_clients_each_get_their_own_completion(server, tokenizer, reference):
    prompts = [[{"role": "user", "content": f"question {i}: {'x' * (i % 9)}"}] for i in range(64)]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="none", timeout=300, max_retries=0) as c:
            return await asyncio.gather(
                *(
                    c.chat.completions.create(
                        model=NAME,
                        messages=m,
                        max_tokens=16,
                        temperature=0,
                        extra_body={"return_token_ids": True},
                    )
                    for m in prompts
                )  # fmt: skip
            )

    outs = asyncio.run(all_at_once())
    want = reference.generate(
        [chat_ids(tokenizer, m) for m in prompts], SamplingParams(temperature=0, max_tokens=16)
    )
    assert [o.model_dump()["choices"][0]["token_ids"] for o in outs] == [w.token_ids for w in want]


def test_a_malformed_request_gets_one_clear_4xx_and_the_server_keeps_serving(server, client):
    base = server.url
    bad = [
        (b"{not json", 400, "json"),
        (json.dumps({"model": NAME}), 400, "messages"),
        (json.dumps({"model": NAME, "messages": MESSAGES, "presence_penalty": 0.5}), 400, "presence_penalty"),
        (
            json.dumps({"model": NAME, "messages": MESSAGES, "top_logprobs": 3, "logprobs": True}),
            400,
            "top_logprobs",
        ),
        (json.dumps({"model": NAME, "messages": MESSAGES, "max_tokens": 10**6}), 400, "max_tokens"),
        (json.dumps({"model": NAME, "messages": MESSAGES, "no_such_field": 1}), 400, "no_such_field"),
        (
            json.dumps({"model": NAME, "messages": [{"role": "user", "content": "x" * 2000}]}),
            400,
            "prompt has",
        ),
        (json.dumps({"model": "gpt-4", "messages": MESSAGES}), 404, "gpt-4"),
        (
            json.dumps({"model": NAME, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            400,
            "image_url",
        ),
    ]
    for payload, status, named in bad:
        r = httpx.post(
            f"{base}/chat/completions", content=payload, headers={"content-type": "application/json"}
        )
        assert r.status_code == status, (payload, r.text)
        message = r.json()["error"]["message"]
        assert named in message.lower() or named in str(r.json()["error"]["param"]), message
        assert "\n" not in message
    with pytest.raises(openai.BadRequestError, match="frequency_penalty"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, frequency_penalty=1.0)
    assert (
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4).choices[0].message
        is not None
    )


def test_a_client_that_leaves_mid_stream_stops_its_request_and_frees_its_pages(server):
    engine = server.front.engine
    payload = {"model": NAME, "messages": MESSAGES, "max_tokens": 400, "temperature": 1.0, "seed": 1,
               "stream": True, "stop_token_ids": [], "n": 3}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/chat/completions", json=payload, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert got[0].startswith("data: ")
        assert engine.scheduler.running  # still generating when the client goes
    deadline = time.monotonic() + 30
    while engine.scheduler.has_work and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.scheduler.has_work
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages
    metrics = httpx.get(f"{server.url.removesuffix('/v1')}/metrics").text
    assert "hybridflow_requests_aborted_total 1.0" in metrics


def test_a_stop_string_ends_the_text_before_it(client):
    args = {"model": NAME, "messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    whole = client.chat.completions.create(**args).choices[0].message.content
    stop = whole[10:13]
    cut = client.chat.completions.create(**args, stop=[stop]).choices[0]
    assert cut.message.content == whole[: whole.find(stop)] and cut.finish_reason == "stop"
    streamed = client.chat.completions.create(**args, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == cut.message.content


def test_models_and_metrics_with_the_prefix_cache_hit_by_a_second_turn(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    first = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=30, temperature=0)
    before = server.front.engine.scheduler.cached_tokens
    turn2 = MESSAGES + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "and 3 + 4?"}]  # fmt: skip
    client.chat.completions.create(model=NAME, messages=turn2, max_tokens=8, temperature=0)
    assert server.front.engine.scheduler.cached_tokens - before >= 32  # the first turn's full pages
    text = httpx.get(f"{server.url.removesuffix('/v1')}/metrics").text
    for name in ("hybridflow_requests_waiting", "hybridflow_sequences_running", "hybridflow_kv_pages_used",
                 "hybridflow_prefix_cache_hit_rate", "hybridflow_generation_tokens_total",
                 "hybridflow_time_to_first_token_seconds_bucket"):  # fmt: skip
        assert f"\n{name}" in text, name


def test_weights_updated_through_the_server_are_used_and_reported(server, client, tokenizer):
    import torch

    engine = server.front.engine
    changed = {n: p + 0.02 * torch.randn_like(p) for n, p in engine.model.named_parameters()}
    version = engine.weight_version
    server.call(lambda e: e.update_weights(list(changed.items())), timeout_s=60)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                         extra_body={"return_token_ids": True}).model_dump()  # fmt: skip
    fresh = make_engine()
    fresh.model.load_state_dict(changed, strict=False)  # a tied head is the embedding
    [want] = fresh.generate([chat_ids(tokenizer, MESSAGES)], SamplingParams(temperature=0, max_tokens=12))
    assert out["choices"][0]["token_ids"] == want.token_ids
    assert set(out["choices"][0]["weight_versions"]) == {version + 1}


HERMES = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_are_rendered_by_the_template_and_calls_parsed_in_its_format():
    assert tool_format(HERMES) == "hermes" and tool_format(byte_tokenizer().chat_template) is None
    text = 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"})
    ]
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken, "hermes") == (broken, [])  # kept, never dropped
    _, calls = parse_tool_calls('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', "mistral")
    assert calls[0]["function"]["arguments"] == '{"a": 1}'
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = HERMES
    server = BackgroundServer(make_engine(), tokenizer, model_name=NAME).start()
    try:
        c = openai.OpenAI(base_url=server.url, api_key="none", timeout=60, max_retries=0)
        history = MESSAGES + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
        out = c.chat.completions.create(model=NAME, messages=history, tools=[WEATHER], max_tokens=4,
                                        extra_body={"return_token_ids": True}).model_dump()  # fmt: skip
        prompt = tokenizer.decode(out["prompt_token_ids"])
        assert (
            '"name": "weather"' in prompt
            and '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}' in prompt
        )
    finally:
        server.stop()
    plain = BackgroundServer(make_engine(), byte_tokenizer(), model_name=NAME).start()
    try:
        with pytest.raises(openai.BadRequestError, match="does not render tools"):
            openai.OpenAI(base_url=plain.url, api_key="none", max_retries=0).chat.completions.create(
                model=NAME, messages=MESSAGES, tools=[WEATHER]
            )
    finally:
        plain.stop()


def test_a_client_that_gives_up_on_a_whole_completion_stops_it(server):
    engine = server.front.engine
    metrics = f"{server.url.removesuffix('/v1')}/metrics"

    def aborted() -> float:
        line = next(
            x
            for x in httpx.get(metrics).text.splitlines()
            if x.startswith("hybridflow_requests_aborted_total")
        )
        return float(line.split()[-1])

    before = aborted()
    server.call(lambda e: e.pause())  # the request waits: the client gives up first
    payload = {"model": NAME, "messages": MESSAGES, "max_tokens": 400, "temperature": 1.0, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/chat/completions", json=payload, timeout=httpx.Timeout(5, read=0.5))
    deadline = time.monotonic() + 30  # the server notices within its poll interval, still paused
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    server.call(lambda e: e.resume())
    assert aborted() == before + 1 and not engine.scheduler.has_work
    assert engine.cache.pool.num_free == engine.cache.pool.num_pages


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_incremental_text_equals_the_whole_decode_with_characters_split_over_tokens(chunk):
    """Byte-level tokens split multi-byte characters: streamed pieces never show half of one, join to
    the whole decode, and a stop string spanning chunks cuts the text right before it."""
    from hybridflow.serve.detokenize import SampleText

    tokenizer = byte_tokenizer()
    text = "héllo wörld — 日本語 🙂 and the END of it"
    ids = tokenizer(text)["input_ids"]
    for stops, want in (([], text), (["END"], text[: text.find("END")]), (["🙂"], text[: text.find("🙂")])):
        s = SampleText(tokenizer, stops, incremental=True)
        pieces = []
        for k in range(0, len(ids), chunk):
            last = k + chunk >= len(ids)
            s.add(ids[k : k + chunk], [0.0] * len(ids[k : k + chunk]), [0.0] * len(ids[k : k + chunk]), 0,
                  "length" if last else None)  # fmt: skip
            pieces.append(s.delta())
            assert "\ufffd" not in pieces[-1]
            if s.done:
                break
        assert "".join(pieces) == want and s.text == want
        assert s.finish_reason == ("stop" if stops else "length")


def test_hybridflow_serve_runs_the_default_model_until_sigterm(capsys):
    import signal
    import socket
    import subprocess
    import sys

    from hybridflow.cli import main

    assert main(["serve", "--port", "70000"]) == 2
    assert "--port 70000 is not a port number" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli",
        "serve",
        "default",
        "--port",
        str(port),
        "--max-model-len",
        "512",
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server never came up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        out = c.chat.completions.create(model="default", messages=[{"role": "user", "content": "What is 2+2?"}],
                                        max_tokens=8, temperature=0)  # fmt: skip
        assert out.choices[0].message.content and out.usage.completion_tokens <= 8
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    # uvicorn shuts down cleanly, then ends by the signal it caught (as systemd and Slurm expect)
    assert process.returncode in (0, -signal.SIGTERM) and "Application shutdown complete" in err, err[-2000:]


def test_with_an_api_key_only_its_bearer_is_served():
    server = BackgroundServer(make_engine(), byte_tokenizer(), model_name=NAME, api_key="s3cret").start()
    try:
        wrong = openai.OpenAI(base_url=server.url, api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError, match="API key"):
            wrong.models.list()
        right = openai.OpenAI(base_url=server.url, api_key="s3cret", max_retries=0)
        assert [m.id for m in right.models.list().data] == [NAME]
        assert httpx.get(f"{server.url.removesuffix('/v1')}/health").status_code == 200  # probes need no key
    finally:
        server.stop()


def test_the_http_process_ends_with_the_engine_process_and_says_why_it_cannot_start():
    """The front's process goes when the engine's process is killed (no orphan holds the port);
    a port in use is one clear error; a front that died is named at the next engine call."""
    import signal
    import socket
    import subprocess
    import sys

    script = (
        "import sys, time; sys.path.insert(0, 'tests/cpu')\n"
        "from test_serve import make_engine, byte_tokenizer, BackgroundServer\n"
        "s = BackgroundServer(make_engine(), byte_tokenizer(), model_name='tiny').start()\n"
        "print(s.processes[0].pid, s.port, flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child_pid, port = map(int, parent.stdout.readline().split())
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 20
        while True:  # the child is not ours to wait for: poll for it
            try:
                os.kill(child_pid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "the HTTP process outlived the engine's process"
            time.sleep(0.1)
    finally:
        parent.kill()

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError, match=f"could not start on 127.0.0.1:{port}: Address already in use"):
            BackgroundServer(make_engine(), byte_tokenizer(), model_name=NAME, port=port).start()

    server = BackgroundServer(make_engine(), byte_tokenizer(), model_name=NAME).start()
    try:
        server.processes[0].kill()
        server.thread.join(20)
        with pytest.raises(RuntimeError, match=r"has stopped .its HTTP processes ended with .-9"):
            server.call(lambda e: e.weight_version)
    finally:
        server.stop()


def test_several_front_processes_share_the_port_the_engine_and_the_metrics(tokenizer, reference):
    """api_processes=3: three HTTP processes accept on one socket; 48 concurrent clients each get what
    the engine samples for them, and any process's /metrics counts every request."""
    server = BackgroundServer(make_engine(), tokenizer, model_name=NAME, api_processes=3).start()
    try:
        assert len({p.pid for p in server.processes}) == 3

        async def one(c: httpx.AsyncClient, i: int) -> list[int]:
            body = {"model": NAME, "prompt": [10 + i, 20, 30], "max_tokens": 6, "temperature": 1.0, "seed": i,
                    "return_token_ids": True}  # fmt: skip
            r = await c.post(f"{server.url}/completions", json=body)
            return r.json()["choices"][0]["token_ids"]

        async def many() -> list[list[int]]:
            limits = httpx.Limits(max_connections=48)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                return await asyncio.gather(*(one(c, i) for i in range(48)))

        got = asyncio.run(many())
        for i in (0, 17, 47):
            params = SamplingParams(max_tokens=6, temperature=1.0, seed=i)
            assert got[i] == reference.generate([[10 + i, 20, 30]], params)[0].token_ids
        metrics = f"{server.url.removesuffix('/v1')}/metrics"
        for _ in range(3):  # new connections: the kernel may hand each to another process
            text = httpx.get(metrics, timeout=10, headers={"Connection": "close"}).text
            line = next(
                x
                for x in text.splitlines()
                if x.startswith('hybridflow_http_requests_total{endpoint="/v1/completions",status="200"}')
            )
            assert float(line.split()[-1]) == 48
    finally:
        server.stop()
    assert not any(p.poll() is None for p in server.processes)


@pytest.mark.parametrize("api_process", [True, False], ids=["api-process", "in-process"])
def test_an_engine_that_fails_answers_503_and_health_says_so(api_process):
    server = BackgroundServer(
        make_engine(), byte_tokenizer(), model_name=NAME, api_process=api_process
    ).start()
    base = server.url.removesuffix("/v1")
    try:

        def lose_the_device(engine) -> None:
            def step():
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

            engine._step = step

        server.call(lose_the_device)
        body = {"model": NAME, "prompt": [5, 6, 7], "max_tokens": 4}
        r = httpx.post(f"{server.url}/completions", json=body, timeout=30)
        assert r.status_code == 503 and "illegal memory access" in r.json()["error"]["message"]
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and "the engine stopped" in health.json()["error"]["message"]
        assert httpx.post(f"{server.url}/completions", json=body, timeout=30).status_code == 503
    finally:
        server.stop()
    # the foreground server (`hybridflow serve`) ends instead, so that a supervisor restarts it
    from hybridflow.serve.server import watch

    server = BackgroundServer(
        make_engine(), byte_tokenizer(), model_name=NAME, api_process=api_process
    ).start()
    try:
        server.call(lose_the_device)
        httpx.post(f"{server.url}/completions", json=body, timeout=30)
        with pytest.raises(UserError, match="the engine stopped .*illegal memory access.*the server ends"):
            watch(server, until=lambda: False, poll_s=0.05)
    finally:
        server.stop()


def test_hostile_requests_fail_alone_and_the_server_stays_fair_and_flat(server, tokenizer, reference):
    """A loop of hostile requests between normal ones: each hostile one gets its own 4xx (never the
    engine's stop), greedy completions stay what the engine gives in-process, the engine keeps no
    state per distinct stop set, and a small request is not held behind a huge one."""
    from hybridflow.engine.engine import STOP_SETS_KEPT

    url = server.url
    prompt = [5, 6, 7]
    want = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6))[0].token_ids
    hostile = [
        ({"prompt": prompt, "stop_token_ids": [10**20]}, 400, "stop_token_ids"),
        ({"prompt": prompt, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
        ({"prompt": [[5] * 3] * 300, "n": 64}, 400, "19200 samples"),
        ({"prompt": [10**12]}, 400, "vocabulary"),
    ]
    chat_hostile = [
        {"role": "assistant", "content": "x", "tool_calls": "zz"},
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": ["a"]}}]},
        {"role": "assistant", "content": "x", "tool_calls": [7]},
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
    ]
    with httpx.Client(timeout=60) as http:
        for _ in range(3):
            for extra, status, named in hostile:
                r = http.post(f"{url}/completions", json={"model": NAME, "max_tokens": 4, **extra})
                assert r.status_code == status and named in r.json()["error"]["message"], r.text
            for message in chat_hostile:
                r = http.post(f"{url}/chat/completions", json={"model": NAME, "messages": [message]})
                assert r.status_code == 400 and "tool_calls" in r.json()["error"]["message"], r.text
            r = http.post(
                f"{url}/completions", content=b"\xff{", headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "code"}
            assert http.get(f"{url}/no/such/route").json()["error"]["code"] == 404  # OpenAI's shape
            # a temperature inside the accepted range that 1/t would overflow: greedy, as vLLM's
            for t in (1e-40, 0.0):
                r = http.post(f"{url}/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 6,
                                                          "temperature": t, "return_token_ids": True})  # fmt: skip
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
        # distinct stop sets (allowed ones) leave no state behind in the engine
        for i in range(2 * STOP_SETS_KEPT):
            r = http.post(f"{url}/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 2,
                                                      "stop_token_ids": [i, i + 1, 200]})  # fmt: skip
            assert r.status_code == 200
        assert len(server.call(lambda engine: engine._stops)) <= STOP_SETS_KEPT
        assert http.get(url.removesuffix("/v1") + "/health").status_code == 200

    async def fairness():
        async with httpx.AsyncClient(timeout=120) as http:
            big = asyncio.ensure_future(http.post(f"{url}/completions", json={
                "model": NAME, "prompt": [[5, 6]] * 4, "n": 64, "max_tokens": 200, "temperature": 1.0}))  # fmt: skip
            await asyncio.sleep(0.2)
            start = time.perf_counter()
            small = await http.post(
                f"{url}/completions", json={"model": NAME, "prompt": prompt, "max_tokens": 4}
            )
            small_s = time.perf_counter() - start
            assert small.status_code == 200 and not big.done()  # served beside the big one, not after it
            assert (await big).status_code == 200
            return small_s

    assert asyncio.run(fairness()) < 30


@pytest.mark.parametrize("api_process", [True, False])
def test_a_slow_loris_connection_is_cut_off_and_others_are_served(api_process):
    """A client that sends its request a byte at a time is disconnected once the request has not
    arrived whole within the deadline; a normal request beside it is answered."""
    import socket

    server = BackgroundServer(make_engine(), byte_tokenizer(), model_name=NAME, api_process=api_process,
                              request_read_timeout_s=1.5).start()  # fmt: skip
    try:
        slow = socket.create_connection((server.host, server.port), timeout=10)
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        r = httpx.post(
            f"{server.url}/completions", json={"model": NAME, "prompt": [5, 6], "max_tokens": 2}, timeout=30
        )
        assert r.status_code == 200
        closed = False
        while time.monotonic() - start < 8:
            try:
                slow.sendall(b"X-Pad: 1\r\n")  # a header line now and then: never the blank line
                if slow.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed = True
                    break
            except BlockingIOError:
                pass
            except OSError:  # reset: closed
                closed = True
                break
            time.sleep(0.3)
        assert closed and time.monotonic() - start < 6
        slow.close()
    finally:
        server.stop()
