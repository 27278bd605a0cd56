"""Prometheus metrics, one registry per app so that two mounted apps never collide."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["UNMATCHED", "Metrics", "status_class"]

UNMATCHED = "unmatched"
"""The endpoint label of requests that matched no route: one label, whatever the path."""


def status_class(status: int) -> str:
    """``2xx``, ``4xx``, ``5xx``...: the status label, so that label values stay few."""
    return f"{status // 100}xx"


class Metrics:
    """Requests, tokens, time to first token, queue depth and errors.

    Labels take few values on purpose: endpoints are route templates
    (``/v1/models/{model_id}``, never the path a client sent), statuses are classes, and
    models are the names served. A label per raw path let one client grow ``/metrics``
    by a series per request."""

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
        self.spec_proposed_tokens = Counter(
            "ortserve_spec_proposed_tokens",
            "Draft tokens checked by speculative decoding",
            ["model"],
            registry=self.registry,
        )
        self.spec_accepted_tokens = Counter(
            "ortserve_spec_accepted_tokens",
            "Draft tokens that became output tokens",
            ["model"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "ortserve_queue_depth", "Requests waiting for the model", ["model"], registry=self.registry
        )
        self.active = Gauge(
            "ortserve_active_requests", "Requests the model is working on", ["model"], registry=self.registry
        )
        # MCP tools the server calls (``server``: a configured label, or "(request url)").
        self.mcp_calls = Counter(
            "ortserve_mcp_calls",
            "MCP tool calls, by outcome (ok, tool_error, error, cancelled)",
            ["server", "tool", "outcome"],
            registry=self.registry,
        )
        self.mcp_call_seconds = Histogram(
            "ortserve_mcp_call_seconds",
            "Time an MCP tool call took",
            ["server"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0, 120.0),
            registry=self.registry,
        )
        self.mcp_list_seconds = Histogram(
            "ortserve_mcp_list_seconds",
            "Time listing an MCP server's tools took (cached lists are not counted)",
            ["server"],
            buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0),
            registry=self.registry,
        )

    def watch_prefix_caches(self, caches: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Report the prefix caches (and running rows) of the engines ``caches()`` names
        (model, engine) at every scrape."""
        self.registry.register(_PrefixCacheCollector(caches))

    def count_request(self, endpoint: str, model: str, status: int) -> None:
        """A request to ``model`` that ended with ``status`` (an error is counted as one too)."""
        self.requests.labels(endpoint, model, status_class(status)).inc()
        if status >= 400:
            self.count_error(endpoint, status)

    def count_drafts(self, model: str, accepted: int, rejected: int) -> None:
        """A request's speculative decoding: ``accepted`` draft tokens taken, ``rejected`` not."""
        if accepted or rejected:
            self.spec_proposed_tokens.labels(model).inc(accepted + rejected)
            self.spec_accepted_tokens.labels(model).inc(accepted)

    def count_error(self, endpoint: str, status: int) -> None:
        self.errors.labels(endpoint, status_class(status)).inc()

    def set_load(self, model: str, queued: int | None, active: int | None) -> None:
        """The queue depth and active requests of ``model``; ``None`` drops its series
        (an unloaded model)."""
        for gauge, value in ((self.queue_depth, queued), (self.active, active)):
            if value is not None:
                gauge.labels(model).set(value)
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(model)

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
        live = GaugeMetricFamily(
            "ortserve_kv_live_bytes", "Key/value bytes the running requests' rows hold", labels=["model"]
        )
        for model, engine in self._caches():
            cache = engine.prefix_cache
            for attribute, family in counters.items():
                family.add_metric([model], getattr(cache, attribute))
            held.add_metric([model], cache.held_bytes)
            live.add_metric([model], engine.live_kv_bytes)
        yield from counters.values()
        yield held
        yield live
