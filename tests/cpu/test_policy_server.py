"""rollout.server=true: the policy being trained is served over the OpenAI API while the run goes
on; the run samples exactly what it samples without the server, and an agent's requests see the
weights move (the weight version of every token); trainer.logger=prometheus exposes the step."""

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from rl_run import config, read_metrics

from hybridflow.controller.trainer import RLTrainer

COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean")


def test_the_trained_policy_is_served_and_the_run_samples_as_without_the_server(setup, tmp_path):
    plain = tmp_path / "plain"
    RLTrainer(config(setup, plain, "trainer.total_training_steps=3")).fit()
    served = tmp_path / "served"
    answers, scrape, stop = [], [], threading.Event()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def agent():  # talks to the policy from the moment the server is up until the run ends
        info = served / "policy_server.json"
        while not info.exists() and not stop.is_set():
            time.sleep(0.01)
        if stop.is_set():
            return
        url = json.loads(info.read_text())["url"]
        client = openai.OpenAI(base_url=url, api_key="none", timeout=60, max_retries=0)
        while not stop.is_set():
            try:
                out = client.chat.completions.create(
                    model=str(setup / "model"), messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                    extra_body={"return_token_ids": True},
                )  # fmt: skip
                answers.append(out.model_dump()["choices"][0]["weight_versions"])
                scrape.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
            except (openai.APIConnectionError, httpx.TransportError):
                if stop.wait(30):  # the servers closed because the run ended: not a failure
                    return
                raise

    thread = threading.Thread(target=agent)
    thread.start()
    trainer = RLTrainer(
        config(
            setup,
            served,
            "trainer.total_training_steps=3",
            "rollout.server=true",
            "rollout.server_api_processes=2",
            "trainer.logger=[jsonl,prometheus]",
            f"trainer.prometheus_port={port}",
        )  # fmt: skip
    )
    trainer.fit()
    stop.set()
    thread.join(60)
    a, b = read_metrics(plain), read_metrics(served)
    for key in COMPARED:
        assert [m[key] for m in b] == pytest.approx([m[key] for m in a], rel=1e-6, abs=1e-9), key
    assert answers and all(v for v in answers)
    assert max(max(v) for v in answers) >= 1  # some answers came from weights the run had updated
    url = json.loads((served / "policy_server.json").read_text())["url"]
    with pytest.raises(httpx.ConnectError):  # the server ended with the run
        httpx.get(url + "/models", timeout=5)
    seen = [t for t in scrape if "hybridflow_trainer_step{" in t]
    assert seen and 'name="timing_s/gen"' in seen[-1] and 'name="critic/score/mean"' in seen[-1]
