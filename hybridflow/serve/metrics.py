"""Prometheus metrics of the server (prometheus_client, one registry per app): requests, tokens,
latencies, and the engine's state read at scrape time (queue depth, running sequences, KV pages,
prefix-cache hits, weight version). Several front processes share PROMETHEUS_MULTIPROC_DIR, and a
scrape of any of them counts the requests of all (prometheus_client's multiprocess mode)."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineCollector:
    """The engine's state, from the dict `stats()` gives (Engine.serving_stats, read in-process or
    fetched from the engine's process before a scrape)."""

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        e = self.stats()
        yield GaugeMetricFamily(
            "hybridflow_requests_waiting", "Prefill jobs waiting for admission", e["waiting"]
        )
        yield GaugeMetricFamily("hybridflow_sequences_running", "Sequences being decoded", e["running"])
        yield GaugeMetricFamily("hybridflow_kv_pages_used", "KV pages held by sequences", e["kv_pages_used"])
        yield GaugeMetricFamily("hybridflow_kv_pages_total", "KV pages in the pool", e["kv_pages_total"])
        yield GaugeMetricFamily(
            "hybridflow_prefix_cache_pages", "Pages kept by the prefix cache", e["prefix_cache_pages"]
        )
        yield CounterMetricFamily(
            "hybridflow_prefill_prompt_tokens", "Tokens admitted to prefill", e["admitted_tokens"]
        )
        yield CounterMetricFamily(
            "hybridflow_prefix_cache_hit_tokens",
            "Admitted tokens found in the prefix cache",
            e["cached_tokens"],
        )
        admitted = e["admitted_tokens"]
        rate = e["cached_tokens"] / admitted if admitted else 0.0
        yield GaugeMetricFamily("hybridflow_prefix_cache_hit_rate", "Hit tokens / admitted tokens", rate)
        yield GaugeMetricFamily(
            "hybridflow_weight_version", "Weight updates applied to the engine", e["weight_version"]
        )
        yield CounterMetricFamily(
            "hybridflow_preemptions", "Sequences preempted (K/V recomputed)", e["preemptions"]
        )


class ServerMetrics:
    """`engine_stats()`: the engine's state as Engine.serving_stats gives it."""

    def __init__(self, engine_stats, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hybridflow_http_requests", "HTTP requests", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter(
            "hybridflow_prompt_tokens", "Prompt tokens of served requests", registry=r
        )
        self.generation_tokens = Counter("hybridflow_generation_tokens", "Tokens generated", registry=r)
        self.latency = Histogram(
            "hybridflow_request_seconds", "Request latency", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.first_token = Histogram(
            "hybridflow_time_to_first_token_seconds",
            "Time to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.aborted = Counter(
            "hybridflow_requests_aborted", "Requests stopped early (client gone)", registry=r
        )
        engine = EngineCollector(engine_stats)
        r.register(engine)
        self.exposition = r  # what /metrics shows
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):  # one of several front processes: all of theirs
            self.exposition = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposition)
            self.exposition.register(engine)
