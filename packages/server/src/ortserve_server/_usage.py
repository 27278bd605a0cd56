"""Usage per API key label and model: requests, errors, input and output tokens, counted in
memory as requests end and added to the state database in batches (every
:data:`FLUSH_SECONDS`, and at shutdown), so that no request waits on a write and the totals
outlive the process. ``/metrics`` shows them as counters; ``GET /v1/usage`` reads them back."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from ._database import Connection, Database, write
from ._errors import storage_full

__all__ = ["FLUSH_SECONDS", "UsageLedger", "UsageTotals", "usage_per_key_shown"]

usage_per_key_shown: contextvars.ContextVar[bool] = contextvars.ContextVar("ortserve_usage_per_key", default=True)
"""Whether the scrape under way may see the ``ortserve_key_*`` series: not where an admin
key is set and the caller did not present it (they show every key's traffic, which
``GET /v1/usage`` keeps to the admin key)."""

logger = logging.getLogger("ortserve.server")

FLUSH_SECONDS = 2.0
"""How often the counts of the requests that ended are added to the database."""


@dataclass(slots=True)
class UsageTotals:
    """What one key label spent on one model."""

    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def add(self, other: UsageTotals) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens


Key = tuple[str, str]
"""(key label, model): ``""`` for a server without keys, and for a request naming no model."""


class UsageLedger:
    """The totals since the database began (read at start) plus what this process counted,
    and the part of it not yet written."""

    def __init__(self, database: Database) -> None:
        self._database = database
        self._totals: dict[Key, UsageTotals] = {}
        self._pending: dict[Key, UsageTotals] = {}
        self._lock = threading.Lock()  # counted on the loop, read by scrapes on other threads
        self._task: asyncio.Task[None] | None = None
        self._loaded = False

    def count(self, key: str, model: str, *, error: bool, input_tokens: int, output_tokens: int) -> None:
        """One request that ended (an error too): in memory now, in the database soon."""
        delta = UsageTotals(1, int(error), input_tokens, output_tokens)
        with self._lock:
            for table in (self._totals, self._pending):
                table.setdefault((key, model), UsageTotals()).add(delta)
        if self._task is None or self._task.done():
            with contextlib.suppress(RuntimeError):  # no running loop: flushed at close
                self._task = asyncio.get_running_loop().create_task(self._flush_soon())

    def totals(self) -> dict[Key, UsageTotals]:
        with self._lock:
            return {
                key: UsageTotals(t.requests, t.errors, t.input_tokens, t.output_tokens)
                for key, t in self._totals.items()
            }

    async def load(self) -> None:
        """Start from the totals in the database (what earlier runs counted); once."""
        if self._loaded:
            return
        self._loaded = True
        rows = await self._database.run(_read)
        with self._lock:
            stored = {key: totals for key, totals in rows}
            for key, totals in self._totals.items():  # counted before the load: on top
                stored.setdefault(key, UsageTotals()).add(totals)
            self._totals = stored

    async def stored(self) -> dict[Key, UsageTotals]:
        """The totals as the database holds them, after what this process counted is written
        (replicas sharing a PostgreSQL database each add theirs there)."""
        await self.flush()
        return dict(await self._database.run(_read))

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_SECONDS)
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - kept for the next flush (the next request schedules one)
            _log_failure("usage per key: the counts could not be stored yet", exc)

    async def flush(self) -> None:
        """Add what was counted since the last flush to the database (one transaction)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        try:
            await self._database.run(lambda db: _add(db, pending))
        except Exception:  # keep the counts for the next flush: the database may come back
            with self._lock:
                for key, totals in pending.items():
                    self._pending.setdefault(key, UsageTotals()).add(totals)
            raise

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            await self.flush()
        except Exception as exc:  # noqa: BLE001 - logged: the counts are lost
            _log_failure("usage per key: the last counts could not be stored", exc)

    def collector(self) -> Collector:
        return _UsageCollector(self)


def _read(db: Connection) -> list[tuple[Key, UsageTotals]]:
    rows = db.execute(
        "SELECT key_label, model, requests, errors, input_tokens, output_tokens FROM key_usage"
    ).fetchall()
    return [((row[0], row[1]), UsageTotals(row[2], row[3], row[4], row[5])) for row in rows]


def _add(db: Connection, pending: dict[Key, UsageTotals]) -> None:
    with write(db):
        db.executemany(
            "INSERT INTO key_usage (key_label, model, requests, errors, input_tokens, output_tokens) "
            "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key_label, model) DO UPDATE SET "
            "requests = key_usage.requests + excluded.requests, errors = key_usage.errors + excluded.errors, "
            "input_tokens = key_usage.input_tokens + excluded.input_tokens, "
            "output_tokens = key_usage.output_tokens + excluded.output_tokens",
            [
                (key, model, t.requests, t.errors, t.input_tokens, t.output_tokens)
                for (key, model), t in pending.items()
            ],
        )


class _UsageCollector(Collector):
    """``ortserve_key_*`` counters by ``key`` (the label) and ``model``, read at each scrape."""

    def __init__(self, ledger: UsageLedger) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[CounterMetricFamily]:
        families = {
            "requests": CounterMetricFamily(
                "ortserve_key_requests", "Requests per API key label and model", labels=["key", "model"]
            ),
            "errors": CounterMetricFamily(
                "ortserve_key_errors",
                "Requests that ended in an error, per API key label and model",
                labels=["key", "model"],
            ),
            "input_tokens": CounterMetricFamily(
                "ortserve_key_input_tokens", "Prompt tokens per API key label and model", labels=["key", "model"]
            ),
            "output_tokens": CounterMetricFamily(
                "ortserve_key_output_tokens", "Generated tokens per API key label and model", labels=["key", "model"]
            ),
        }
        if not usage_per_key_shown.get():
            return
        for (key, model), totals in sorted(self._ledger.totals().items()):
            for attribute, family in families.items():
                family.add_metric([key, model], getattr(totals, attribute))
        yield from families.values()


def _log_failure(message: str, exc: Exception) -> None:
    """A full disk is the operator's to fix, said in a line (a traceback says nothing more)."""
    if storage_full(exc) is not None:
        logger.error("%s: the disk is full", message)
    else:
        logger.error(message, exc_info=exc)
