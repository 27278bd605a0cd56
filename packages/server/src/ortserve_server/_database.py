"""The one SQLite database behind ortserve's state (stored Responses, runtime adapters,
files and batches): a file under ``ServerConfig.state_dir`` that outlives the process, or
an in-memory database (``state_dir`` ``None``) with the same code paths.

Every call runs on one thread of its own, in the order of the calls, so no call blocks
the event loop on the disk and a write is visible to the next call (a response stored by
one request is readable by the next one naming it). The file is opened in WAL mode;
writers take ``BEGIN IMMEDIATE``, so processes sharing a file wait their turn. The schema
is versioned (``PRAGMA user_version``) and migrated forward step by step; a file of a newer
version than this code knows is refused rather than misread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["STATE_FILE", "Database", "write"]

STATE_FILE = "ortserve.db"
"""The SQLite file under ``state_dir``."""

T = TypeVar("T")

_MIGRATIONS = [
    # 1: stored Responses
    """
    CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, created REAL NOT NULL,
        expires REAL NOT NULL, size INTEGER NOT NULL, response BLOB NOT NULL, items BLOB NOT NULL);
    CREATE INDEX IF NOT EXISTS responses_by_age ON responses (created);
    """,
    # 2: runtime LoRA adapters, files and batches
    """
    CREATE TABLE adapters (model TEXT NOT NULL, name TEXT NOT NULL, path TEXT NOT NULL,
        created REAL NOT NULL, PRIMARY KEY (model, name));
    CREATE TABLE files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL,
        filename TEXT NOT NULL, bytes INTEGER NOT NULL, created REAL NOT NULL, expires REAL,
        content BLOB NOT NULL);
    CREATE INDEX files_by_owner ON files (owner, created);
    CREATE TABLE batches (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
        status TEXT NOT NULL, scope TEXT, batch BLOB NOT NULL);
    CREATE INDEX batches_by_owner ON batches (owner, created);
    CREATE TABLE batch_lines (batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL,
        request BLOB NOT NULL, status INTEGER, answer BLOB, PRIMARY KEY (batch_id, line));
    """,
]
SCHEMA_VERSION = len(_MIGRATIONS)


class Database:
    """A SQLite connection (file ``path``, or in memory when ``None``) and the thread that
    makes every call on it."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        # Opened here, used on the worker thread only (check_same_thread would refuse that).
        self._db = sqlite3.connect(
            ":memory:" if path is None else path, check_same_thread=False, isolation_level=None, timeout=30
        )
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ortserve-state")

    def _migrate(self) -> None:
        db = self._db
        if self.path is not None:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses no committed write
        with db:
            db.execute("BEGIN IMMEDIATE")  # two processes opening one new file: one migrates
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ValueError(
                    f"{self.path} was written by a newer ortserve (state schema {version}); use another state dir"
                )
            for step in _MIGRATIONS[version:]:
                for statement in filter(str.strip, step.split(";")):
                    db.execute(statement)
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def submit(self, call: Callable[[sqlite3.Connection], T]) -> concurrent.futures.Future[T]:
        """Queue ``call(connection)``; the future is done once it has run (committed)."""
        return self._worker.submit(call, self._db)

    async def run(self, call: Callable[[sqlite3.Connection], T]) -> T:
        """``call(connection)`` on the worker thread, awaited."""
        return await asyncio.wrap_future(self.submit(call))

    def close(self) -> None:
        """Finish queued calls and close the database."""
        self._worker.submit(self._db.close)
        self._worker.shutdown(wait=True)


def write(db: sqlite3.Connection) -> sqlite3.Connection:
    """Begin a write transaction on ``db`` (use as ``with write(db):``)."""
    db.execute("BEGIN IMMEDIATE")
    return db
