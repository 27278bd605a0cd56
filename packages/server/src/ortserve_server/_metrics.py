"""Prometheus metrics, one registry per app so that two mounted apps never collide."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["Metrics"]


class Metrics:
    """Requests, tokens, time to first token, queue depth and errors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "ortserve_requests", "Requests handled", ["endpoint", "model", "status"], registry=self.registry
        )
        self.errors = Counter(
            "ortserve_errors", "Requests that ended in an error", ["endpoint", "status"], registry=self.registry
        )
        self.prompt_tokens = Counter(
            "ortserve_prompt_tokens", "Prompt tokens processed", ["model"], registry=self.registry
        )
        self.completion_tokens = Counter(
            "ortserve_completion_tokens", "Tokens generated", ["model"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "ortserve_time_to_first_token_seconds",
            "From request start to the first generated token",
            ["model"],
            buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "ortserve_queue_depth", "Requests waiting for a batch row", ["model"], registry=self.registry
        )
        self.active = Gauge(
            "ortserve_active_requests", "Requests holding a batch row", ["model"], registry=self.registry
        )

    def watch_prefix_caches(self, caches: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Report the prefix caches ``caches()`` names (model, cache) at every scrape."""
        self.registry.register(_PrefixCacheCollector(caches))

    def __deepcopy__(self, memo: dict[int, object]) -> Metrics:
        # Litestar deep-copies route options; the registry is shared, never copied.
        return self

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PrefixCacheCollector(Collector):
    """The ort-cpu engines' prefix caches, read when scraped (their counters live in the
    engine, which must not wait on the metrics)."""

    def __init__(self, caches: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._caches = caches

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        counters = {
            "hits": CounterMetricFamily(
                "ortserve_prefix_cache_hits", "Requests that reused a cached prefix", labels=["model"]
            ),
            "hit_tokens": CounterMetricFamily(
                "ortserve_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache", labels=["model"]
            ),
            "misses": CounterMetricFamily(
                "ortserve_prefix_cache_misses", "Requests that found no prefix", labels=["model"]
            ),
            "evictions": CounterMetricFamily(
                "ortserve_prefix_cache_evictions", "Entries dropped to stay within the budget", labels=["model"]
            ),
        }
        held = GaugeMetricFamily(
            "ortserve_prefix_cache_bytes", "Key/value bytes the prefix cache holds", labels=["model"]
        )
        for model, cache in self._caches():
            for attribute, family in counters.items():
                family.add_metric([model], getattr(cache, attribute))
            held.add_metric([model], cache.held_bytes)
        yield from counters.values()
        yield held
