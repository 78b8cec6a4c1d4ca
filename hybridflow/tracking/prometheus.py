"""trainer.logger: prometheus — the run's metrics on an HTTP endpoint a Prometheus server scrapes
(prometheus_client): every numeric metric of the last step as a gauge (`hybridflow_trainer_metric
{name="timing_s/gen"}`: the step's phase times among them) and the step itself."""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from hybridflow.errors import UserError


class PrometheusSink:
    def __init__(self, host: str, port: int, experiment: str) -> None:
        self.registry = CollectorRegistry()
        self.step = Gauge(
            "hybridflow_trainer_step", "Last step logged", ["experiment"], registry=self.registry
        )
        self.metric = Gauge(
            "hybridflow_trainer_metric",
            "A metric of the last step",
            ["experiment", "name"],
            registry=self.registry,
        )
        self.experiment = experiment
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise UserError(
                f"trainer.prometheus_port={port}: cannot listen on {host}:{port} ({e.strerror or e}); "
                "choose another port"
            ) from e
        self.port = self.server.server_port

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.step.labels(self.experiment).set(step)
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.metric.labels(self.experiment, key).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
