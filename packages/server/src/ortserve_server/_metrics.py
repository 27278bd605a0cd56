"""Prometheus metrics, one registry per app so that two mounted apps never collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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

    def __deepcopy__(self, memo: dict[int, object]) -> Metrics:
        # Litestar deep-copies route options; the registry is shared, never copied.
        return self

    def render(self) -> bytes:
        return generate_latest(self.registry)
