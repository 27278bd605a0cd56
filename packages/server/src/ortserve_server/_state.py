"""The state the routes share; one per mounted ortserve."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from ortserve_runtime import ModelRegistry

from ._config import ServerConfig
from ._metrics import Metrics

__all__ = ["OrtServe"]


class OrtServe:
    """The state our routes share: configuration, model registry and metrics."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        unknown = sorted(set(config.model_configs) - set(config.models))
        if unknown:
            raise ValueError(f"model_configs names models that are not served: {', '.join(unknown)}")
        self.registry = ModelRegistry(config.model_config)
        for name, path in config.models.items():
            self.registry.add(name, path, config.model_configs.get(name))
        self.metrics = Metrics()
        self.metrics.watch_prefix_caches(self._prefix_caches)
        self.created = int(time.time())
        self.started = False

    def _prefix_caches(self) -> list[tuple[str, Any]]:
        loaded = ((name, self.registry.loaded(name)) for name in self.registry.names())
        caches = ((name, getattr(getattr(model, "engine", None), "prefix_cache", None)) for name, model in loaded)
        return [(name, cache) for name, cache in caches if cache is not None]

    def __deepcopy__(self, memo: dict[int, Any]) -> OrtServe:
        # Litestar deep-copies routers when it registers them; the models, threads and
        # metrics behind them are one shared service, never copied.
        return self

    async def startup(self) -> None:
        if self.config.load_on_startup:
            for name in self.registry.names():
                await self.registry.load(name)
        self.started = True

    async def shutdown(self) -> None:
        await self.registry.close()

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Any = None) -> AsyncIterator[None]:
        """Load models up front, close them at the end."""
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()
