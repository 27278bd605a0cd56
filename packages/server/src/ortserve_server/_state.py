"""The state the routes share; one per mounted ortserve."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from ortserve_runtime import ModelCapacityError, ModelLoadError, ModelRegistry

from ._adapter_store import AdapterStore
from ._batch_store import BatchStore
from ._body_budget import BodyBudget
from ._config import ServerConfig, check_server_config, model_registry
from ._conversation_store import ConversationStore
from ._database import STATE_FILE, Database
from ._mcp import McpHub
from ._metrics import Metrics
from ._observe import Observer
from ._record import RequestRecord
from ._response_store import ResponseStore
from ._usage import UsageLedger

__all__ = ["BatchWork", "OrtServe"]

logger = logging.getLogger("ortserve.server")


class BatchWork(Protocol):
    """The Batch API's runner as the state and the batch routes see it (``_batch_runner``:
    it sits above the routes, which sit above this module)."""

    def start(self) -> None: ...

    def cancel(self, batch_id: str) -> None: ...

    async def stop(self) -> None: ...


class OrtServe:
    """The state our routes share: configuration, model registry and metrics."""

    def __init__(self, config: ServerConfig, registry: ModelRegistry | None = None) -> None:
        """``registry``: :func:`model_registry`'s for ``config``, made earlier (``ortserve
        serve`` starts loading models before this module imports); made here otherwise."""
        self.config = config
        if registry is None:
            registry = model_registry(config)  # checks config first
        else:
            check_server_config(config)
        self.registry = registry
        self.metrics = Metrics()
        self.body_budget = BodyBudget(config.max_body_memory, config.max_body_size)
        """The request bodies held at once, charged by every API route."""
        self.metrics.watch_prefix_caches(self._prefix_caches)
        self.created = int(time.time())
        state_file = None if config.state_dir is None else Path(config.state_dir) / STATE_FILE
        try:
            self.database = Database(url=config.state_url) if config.state_url is not None else Database(state_file)
        except (OSError, sqlite3.Error) as exc:
            raise ValueError(f"state_dir: cannot keep state in {state_file}: {exc}") from exc
        except Exception as exc:  # psycopg's errors: a server not there, a wrong password
            if config.state_url is None:
                raise
            raise ValueError(f"state_url: cannot keep state in PostgreSQL: {exc}") from exc
        """Where state is kept: a file under ``state_dir``, or memory."""
        self.responses = ResponseStore(
            self.database, config.responses_store_max, config.responses_store_max_bytes, config.responses_store_ttl
        )
        """Responses kept for ``previous_response_id`` (``/v1/responses`` with ``store: true``)."""
        self.mcp = McpHub(config, self.metrics)
        """The MCP servers the operator configured, connected on first use."""
        self.adapters = AdapterStore(self.database)
        """LoRA adapters loaded over HTTP, served again after a restart."""
        self.batches = BatchStore(self.database, config.files_max_bytes, config.files_ttl, len(config.api_keys))
        """Files and batches (the Batch API)."""
        self.conversations = ConversationStore(self.database)
        """The web page's conversations."""
        self.usage = UsageLedger(self.database)
        """Requests, errors and tokens per API key label and model, kept in the database."""
        self.metrics.registry.register(self.usage.collector())
        self.observer = Observer(config, self._count_usage)
        """Request ids, the access log line, usage per key and traces (``_observe``)."""
        self._batch_runner: BatchWork | None = None
        self.started = False
        self.cut_requests = 0
        """Requests that :meth:`cut_work` (or a harder stop) ended before they finished."""
        self._cut_off = False
        self._cut_waiters: set[asyncio.Future[None]] = set()

    @property
    def batch_runner(self) -> BatchWork:
        """What works through the Batch API's lines: attached with the routes (it runs each
        line through them), by :meth:`attach_batch_runner`."""
        if self._batch_runner is None:
            raise RuntimeError("no batch runner: this state's routes were never made")
        return self._batch_runner

    def attach_batch_runner(self, make: Callable[[OrtServe], BatchWork]) -> None:
        """Make the batch runner unless there is one (a state whose routes are made twice
        keeps its first)."""
        if self._batch_runner is None:
            self._batch_runner = make(self)

    def _prefix_caches(self) -> list[tuple[str, Any]]:
        """The loaded models' engines that keep a prefix cache (ort-cpu), by name."""
        loaded = ((name, getattr(self.registry.loaded(name), "engine", None)) for name in self.registry.names())
        return [(name, engine) for name, engine in loaded if getattr(engine, "prefix_cache", None) is not None]

    def __deepcopy__(self, memo: dict[int, Any]) -> OrtServe:
        # Litestar deep-copies routers when it registers them; the models, threads and
        # metrics behind them are one shared service, never copied.
        return self

    def cut_work(self) -> None:
        """End the generations and transcriptions under way now (a shutdown whose grace
        period ran out): streams end with an in-band error event and ``[DONE]``, other
        requests answer 503, so that no client sees a bare closed connection. Work that
        starts afterwards is cut at once."""
        self._cut_off = True
        for waiter in list(self._cut_waiters):
            waiter.get_loop().call_soon_threadsafe(_settle, waiter)

    @property
    def cut_off(self) -> bool:
        """Whether :meth:`cut_work` was called: work that starts now is cut at once."""
        return self._cut_off

    @contextlib.contextmanager
    def cut_signal(self) -> Iterator[asyncio.Future[None]]:
        """A future of the running loop that :meth:`cut_work` resolves, while in the block."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._cut_off:
            waiter.set_result(None)
        self._cut_waiters.add(waiter)
        try:
            yield waiter
        finally:
            self._cut_waiters.discard(waiter)
            waiter.cancel()

    def _count_usage(self, record: RequestRecord) -> None:
        if record.key is None and self.config.api_keys:
            return  # never got past the key check: nobody to count it for
        if record.model is None and record.status < 400:
            return  # listing models, reading usage: no model's work to count
        self.usage.count(
            record.key or "",
            record.model or "",
            error=record.status >= 400,
            input_tokens=record.input_tokens,
            output_tokens=record.output_tokens,
        )

    async def startup(self) -> None:
        await self.usage.load()
        if self.config.runtime_adapters:
            await self.adapters.restore(self.registry)
        if self.config.load_on_startup:
            # Up to --max-loaded-models and while they fit the memory budget; the rest
            # load on first use (loading them all would only evict the first ones).
            # A model that cannot load fails alone (its status says why, and the next request
            # to it tries again) while the others serve; if none loads, there is nothing to
            # serve and the first failure is the server's.
            limit = self.config.max_loaded_models
            failures: list[ModelLoadError] = []
            names = self.registry.names()[:limit]
            for name in names:
                try:
                    await self.registry.load(name)
                except ModelCapacityError as exc:
                    logger.warning("not loading %s at startup: %s", name, exc)
                    break
                except ModelLoadError as exc:
                    logger.error("model %s failed to load, the others serve: %s", name, exc)
                    failures.append(exc)
            if failures and len(failures) == len(names):
                raise failures[0]
        if self._batch_runner is not None:
            self._batch_runner.start()  # open batches go on where the last run left them
        self.started = True

    async def shutdown(self) -> None:
        if self._batch_runner is not None:
            await self._batch_runner.stop()  # lines without an answer run again at the next start
        await self.mcp.close()  # stdio servers' processes end with the app
        await self.registry.close()
        await self.usage.close()
        await self.observer.close()  # spans still buffered go out
        await asyncio.to_thread(self.database.close)  # queued writes land before the process ends

    @contextlib.asynccontextmanager
    async def lifespan(self, _: Any = None) -> AsyncIterator[None]:
        """Load models up front, close them at the end."""
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
