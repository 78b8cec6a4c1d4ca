"""Prometheus metrics of the server (prometheus_client, one registry per app): requests, tokens,
latencies, and the engine's state read at scrape time (queue depth, running sequences, KV pages,
prefix-cache hits, weight version)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineCollector:
    """Reads the engine when scraped (plain attribute reads: safe beside the stepping thread)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine
        s, pool = e.scheduler, e.cache.pool
        yield GaugeMetricFamily(
            "hybridflow_requests_waiting", "Prefill jobs waiting for admission", len(s.waiting)
        )
        yield GaugeMetricFamily("hybridflow_sequences_running", "Sequences being decoded", len(s.running))
        yield GaugeMetricFamily(
            "hybridflow_kv_pages_used", "KV pages held by sequences", pool.num_pages - pool.num_free
        )
        yield GaugeMetricFamily("hybridflow_kv_pages_total", "KV pages in the pool", pool.num_pages)
        yield GaugeMetricFamily(
            "hybridflow_prefix_cache_pages", "Pages kept by the prefix cache", pool.num_cached
        )
        yield CounterMetricFamily(
            "hybridflow_prefill_prompt_tokens", "Tokens admitted to prefill", s.admitted_tokens
        )
        yield CounterMetricFamily(
            "hybridflow_prefix_cache_hit_tokens", "Admitted tokens found in the prefix cache", s.cached_tokens
        )
        rate = s.cached_tokens / s.admitted_tokens if s.admitted_tokens else 0.0
        yield GaugeMetricFamily("hybridflow_prefix_cache_hit_rate", "Hit tokens / admitted tokens", rate)
        yield GaugeMetricFamily(
            "hybridflow_weight_version", "Weight updates applied to the engine", e.weight_version
        )
        yield CounterMetricFamily(
            "hybridflow_preemptions", "Sequences preempted (K/V recomputed)", s.preemptions
        )


class ServerMetrics:
    def __init__(self, engine, registry: CollectorRegistry | None = None) -> None:
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
        r.register(EngineCollector(engine))
