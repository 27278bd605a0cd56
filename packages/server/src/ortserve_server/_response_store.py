"""The bounded store behind ``store``/``previous_response_id`` of ``/v1/responses``: in
memory, or in a SQLite file that outlives the process (``ServerConfig.state_dir``), so a
restart (an upgrade, a crash, a sidecar host restarting it) keeps every stored response
and the chains of agent clients that continue them.

The SQLite file is opened in WAL mode and written by one thread of its own, in the order
of the calls (a response is readable by the next request that names it); reads and deletes
go through that thread too, so no call blocks the event loop on the disk. Its schema is
versioned (``PRAGMA user_version``); a file of a newer version than this code knows is
refused rather than misread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from ortserve_client import responses_protocol as rp

__all__ = ["STATE_FILE", "ResponseStore", "StoredResponse"]

STATE_FILE = "ortserve.db"
"""The SQLite file under ``state_dir``."""
SCHEMA_VERSION = 1

_decode_response = msgspec.json.Decoder(rp.Response).decode
_decode_items = msgspec.json.Decoder(list[rp.InputItem]).decode


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: rp.Response
    items: list[rp.InputItem]
    """The conversation a follow-up continues: the items it had as input (those of its own
    ``previous_response_id`` first; ``instructions`` not among them) and then its output."""
    size: int
    expires: float


class ResponseStore:
    """Responses by id, bounded three ways (count, bytes, age) so that no client can grow
    the server without end: a put evicts the oldest entries until the new one fits, and a
    get of an expired entry finds nothing. In memory (``path`` ``None``), or in the SQLite
    file ``path``."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl: float,
        path: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.path = path
        self._clock = clock
        self._memory = _MemoryResponses() if path is None else None
        self._file = _SqliteResponses(path) if path is not None and self.enabled else None
        self._writer = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ortserve-state")
            if self._file is not None
            else None
        )

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def put(self, response: rp.Response, items: list[rp.InputItem]) -> concurrent.futures.Future[None] | None:
        """Keep ``response`` and its conversation; one larger than the byte bound is not
        kept. In the file, the write is queued (a later get sees it): the future is done
        once it is committed."""
        encoded = (msgspec.json.encode(response), msgspec.json.encode(items))
        size = len(encoded[0]) + len(encoded[1])
        if not self.enabled or size > self.max_bytes:
            return None
        now = self._clock()
        if self._file is not None and self._writer is not None:
            return self._writer.submit(
                self._file.put, response.id, *encoded, size, now, now + self.ttl, self.max_entries, self.max_bytes
            )
        if self._memory is not None:
            self._memory.put(response, items, size, now, now + self.ttl, self.max_entries, self.max_bytes)
        return None

    async def get(self, response_id: str) -> StoredResponse | None:
        now = self._clock()
        if self._memory is not None:
            return self._memory.get(response_id, now)
        found = await self._in_writer(self._file.get if self._file else _nothing, response_id, now)
        return found if isinstance(found, StoredResponse) else None

    async def delete(self, response_id: str) -> bool:
        now = self._clock()
        if self._memory is not None:
            return self._memory.delete(response_id, now)
        return bool(await self._in_writer(self._file.delete if self._file else _nothing, response_id, now))

    def close(self) -> None:
        """Finish queued writes and close the file."""
        if self._writer is not None and self._file is not None:
            self._writer.submit(self._file.close)
            self._writer.shutdown(wait=True)

    async def _in_writer(self, call: Callable[[str, float], object], *args: object) -> object:
        assert self._writer is not None
        return await asyncio.wrap_future(self._writer.submit(call, *args))  # type: ignore[arg-type]


def _nothing(*_: object) -> None:
    return None


class _MemoryResponses:
    """The entries in this process, oldest first. One event loop: no locking."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def put(
        self,
        response: rp.Response,
        items: list[rp.InputItem],
        size: int,
        now: float,
        expires: float,
        max_entries: int,
        max_bytes: int,
    ) -> None:
        self._expire(now)
        while self._entries and (len(self._entries) >= max_entries or self._bytes + size > max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response.id] = StoredResponse(response, items, size, expires)
        self._bytes += size

    def get(self, response_id: str, now: float) -> StoredResponse | None:
        self._expire(now)
        return self._entries.get(response_id)

    def delete(self, response_id: str, now: float) -> bool:
        self._expire(now)
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def _expire(self, now: float) -> None:
        # Insertion order is expiry order (one ttl for all), so the expired ones lead.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now:
                break
            self._drop(oldest.response.id)

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._entries.pop(response_id).size


class _SqliteResponses:
    """The entries in a SQLite file; every call on the store's one writer thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Opened here, used on the writer thread only (check_same_thread would refuse that).
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses no committed write
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            self._db.close()
            raise ValueError(f"{path} was written by a newer ortserve (state schema {version}); use another state dir")
        if version < 1:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute(
                    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created REAL NOT NULL,"
                    " expires REAL NOT NULL, size INTEGER NOT NULL, response BLOB NOT NULL, items BLOB NOT NULL)"
                )
                self._db.execute("CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created)")
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def put(
        self,
        response_id: str,
        response: bytes,
        items: bytes,
        size: int,
        now: float,
        expires: float,
        max_entries: int,
        max_bytes: int,
    ) -> None:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")  # other processes sharing the file wait their turn
            self._db.execute("DELETE FROM responses WHERE expires <= ?", (now,))
            count, held = self._db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
            oldest = self._db.execute("SELECT id, size FROM responses ORDER BY created")
            drop = []
            for old_id, old_size in oldest:
                if count < max_entries and held + size <= max_bytes:
                    break
                drop.append((old_id,))
                count, held = count - 1, held - old_size
            self._db.executemany("DELETE FROM responses WHERE id = ?", drop)
            self._db.execute(
                "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                (response_id, now, expires, size, response, items),
            )

    def get(self, response_id: str, now: float) -> StoredResponse | None:
        row = self._db.execute(
            "SELECT response, items, size, expires FROM responses WHERE id = ? AND expires > ?", (response_id, now)
        ).fetchone()
        if row is None:
            return None
        return StoredResponse(_decode_response(row[0]), _decode_items(row[1]), row[2], row[3])

    def delete(self, response_id: str, now: float) -> bool:
        with self._db:
            self._db.execute("BEGIN IMMEDIATE")
            deleted = self._db.execute(
                "DELETE FROM responses WHERE id = ? AND expires > ?", (response_id, now)
            ).rowcount
        return bool(deleted)

    def close(self) -> None:
        self._db.close()
