"""The rollout backend of a trainer that also serves its policy (rollout.server=true): the engine is
driven by the server's AsyncEngine, so the trainer's generation, weight updates, sleep and wake are
all run by that one driver, between two steps, beside the agents' requests."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from hybridflow.errors import UserError
from hybridflow.run_manifest import write_text_atomic
from hybridflow.serve.server import BackgroundServer

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 3600.0  # a step's generation; the trainer's watchdog names a stuck phase sooner


class ServedEngine:
    def __init__(self, server: BackgroundServer) -> None:
        self.server = server
        self.engine = server.front.engine

    def generate(self, prompt_token_ids, params):
        return self.server.run(
            lambda: self.server.front.generate_batch(prompt_token_ids, params), CALL_TIMEOUT_S
        )

    def update_weights(self, named_tensors) -> int:
        tensors = list(named_tensors)
        return self.server.call(lambda e: e.update_weights(tensors), CALL_TIMEOUT_S)

    def weight_tensors(self):
        return self.engine.weight_tensors()

    def resize_pool(self) -> None:
        self.server.call(lambda e: e.resize_pool(), CALL_TIMEOUT_S)

    def sleep(self) -> None:
        """Requests in flight keep their tokens; their K/V go with the pool (recomputed after wake)."""

        def sleep(e) -> None:
            e.pause()
            e.scheduler.preempt_all()
            e.sleep()

        self.server.call(sleep, CALL_TIMEOUT_S)

    def wake(self) -> None:
        def wake(e) -> None:
            if e.asleep:
                e.wake()
            e.resume()

        self.server.call(wake, CALL_TIMEOUT_S)

    def close(self) -> None:
        self.server.stop()


SERVER_FILE = "policy_server.json"


def serve_policy(backend, tokenizer, config, world_size: int, run_dir: Path) -> ServedEngine:
    """rollout.server=true: the engine behind a BackgroundServer; its URL in RUN_DIR/policy_server.json."""
    from hybridflow.engine import Engine

    r = config.rollout
    if not isinstance(backend, Engine):
        raise UserError("rollout.server=true serves the built-in engine; set rollout.backend=native")
    if world_size > 1 or config.resources.rollout_workers:
        raise UserError("rollout.server=true runs with one training worker and no rollout workers, for now")
    name = config.model.path
    server = BackgroundServer(
        backend, tokenizer, model_name=name, host=r.server_host, port=r.server_port,
        api_processes=r.server_api_processes,
    ).start()  # fmt: skip
    record = {"url": server.url, "model": name, "pid": os.getpid()}
    write_text_atomic(run_dir / SERVER_FILE, json.dumps(record) + "\n")
    log.info("the policy being trained is served at %s (model %r)", server.url, name)
    return ServedEngine(server)
