"""The one database behind ortserve's state (stored Responses, runtime adapters, files,
batches, usage per key, the web page's conversations): a SQLite file under
``ServerConfig.state_dir`` that outlives the process, an in-memory SQLite database
(``state_dir`` ``None``) with the same code paths, or PostgreSQL (``ServerConfig.state_url``),
which replicas on several machines share.

Every call runs on one thread of its own, in the order of the calls, so no call blocks
the event loop on the disk and a write is visible to the next call (a response stored by
one request is readable by the next one naming it). The SQLite file is opened in
WAL mode; writers take ``BEGIN IMMEDIATE``, so processes sharing a file wait their turn.
The SQL is written to run on both (``?`` placeholders become psycopg's ``%s``; BLOB and REAL
columns become BYTEA and DOUBLE PRECISION). The schema is versioned (SQLite's ``PRAGMA
user_version``, a one-row table in PostgreSQL) and migrated forward step by step under a
lock; a database of a newer version than this code knows is refused rather than misread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import sqlite3
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

__all__ = ["STATE_FILE", "Connection", "Database", "write"]

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
        status TEXT NOT NULL, scope TEXT, batch BLOB NOT NULL, runner TEXT, lease REAL);
    CREATE INDEX batches_by_owner ON batches (owner, created);
    CREATE TABLE batch_lines (batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT NOT NULL,
        request BLOB NOT NULL, status INTEGER, answer BLOB, PRIMARY KEY (batch_id, line));
    """,
    # 3: stored Responses belong to the key that stored them (as files and batches do); those
    # stored before have no owner: only callers without a key (a server without keys) see them
    """
    ALTER TABLE responses ADD COLUMN owner TEXT NOT NULL DEFAULT '';
    """,
    # 4: the web page's conversations, per owner (the API key's digest); ``text`` is the
    # title and the messages' text case-folded, for search
    """
    CREATE TABLE ui_conversations (id TEXT PRIMARY KEY, owner TEXT NOT NULL, title TEXT NOT NULL,
        model TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL, message_count INTEGER NOT NULL,
        size INTEGER NOT NULL, body BLOB NOT NULL, text TEXT NOT NULL);
    CREATE INDEX ui_conversations_by_owner ON ui_conversations (owner, updated);
    """,
    # 5: usage per API key label and model (never the key); a batch's trace context (the
    # W3C traceparent of the request that created it), which its lines' spans continue
    """
    CREATE TABLE key_usage (key_label TEXT NOT NULL, model TEXT NOT NULL, requests BIGINT NOT NULL,
        errors BIGINT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL,
        PRIMARY KEY (key_label, model));
    ALTER TABLE batches ADD COLUMN trace TEXT;
    """,
    # 6: how many of a stored response's items came from its previous response (NULL: stored
    # before this was kept), so that deleting it removes its own from the responses after it
    """
    ALTER TABLE responses ADD COLUMN inherited INTEGER;
    """,
    # 7: what a delete removed (the deleted response's last output id and its own items' ids),
    # for a while, so that a response still generating when the response it continued was
    # deleted is stored without it too
    """
    CREATE TABLE response_deletions (owner TEXT NOT NULL, last_output_id TEXT NOT NULL,
        forgotten BLOB NOT NULL, deleted REAL NOT NULL);
    CREATE INDEX response_deletions_by_owner ON response_deletions (owner, deleted);
    """,
    # 8: how many times each batch line was started, so that a line the server died running
    # (again and again: a crash it provokes) is not resumed for ever
    """
    ALTER TABLE batch_lines ADD COLUMN started INTEGER NOT NULL DEFAULT 0;
    """,
]
SCHEMA_VERSION = len(_MIGRATIONS)


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...
    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...
    def __iter__(self) -> Iterator[Any]: ...


class Connection(Protocol):
    """What the stores use of a connection: sqlite3's, or :class:`_Postgres`."""

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Cursor: ...
    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> object: ...
    def close(self) -> None: ...


class Database:
    """A connection (a SQLite file ``path``, in memory when ``None``; or PostgreSQL at
    ``url``) and the thread that makes every call on it."""

    def __init__(self, path: Path | None = None, *, url: str | None = None) -> None:
        self.path = path
        self.url = url
        self._db: Connection
        if url is not None:
            self._db = _Postgres(url)
        else:
            if path is not None:
                _private_file(path)
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

    @property
    def where(self) -> str:
        """The database, for messages (a URL without its password)."""
        if self.url is not None:
            return re.sub(r"//([^:/@]+):[^@/]*@", r"//\1:***@", self.url)
        return str(self.path) if self.path is not None else "memory"

    def _migrate(self) -> None:
        db = self._db
        if self.url is None and self.path is not None:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses no committed write
        with write(db):  # two processes opening one new database: one migrates
            if isinstance(db, _Postgres):
                db.execute("SELECT pg_advisory_xact_lock(7227101)")  # CREATE TABLE IF NOT EXISTS races otherwise
                db.execute("CREATE TABLE IF NOT EXISTS ortserve_schema (version INTEGER NOT NULL)")
                row = db.execute("SELECT version FROM ortserve_schema").fetchone()
                version = 0 if row is None else row[0]
            else:
                version = db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ValueError(
                    f"{self.where} was written by a newer ortserve (state schema {version}); use another state dir"
                )
            for step in _MIGRATIONS[version:]:
                for statement in filter(str.strip, step.split(";")):
                    db.execute(statement)
            if isinstance(db, _Postgres):
                db.execute("DELETE FROM ortserve_schema")
                db.execute("INSERT INTO ortserve_schema VALUES (?)", (SCHEMA_VERSION,))
            else:
                db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def submit(self, call: Callable[[Connection], T]) -> concurrent.futures.Future[T]:
        """Queue ``call(connection)``; the future is done once it has run (committed)."""
        return self._worker.submit(call, self._db)

    async def run(self, call: Callable[[Connection], T]) -> T:
        """``call(connection)`` on the worker thread, awaited."""
        return await asyncio.wrap_future(self.submit(call))

    def close(self) -> None:
        """Finish queued calls and close the database."""
        self._worker.submit(self._db.close)
        self._worker.shutdown(wait=True)


def _private_file(path: Path) -> None:
    """Make the state dir (0700) and the SQLite file (0600) whatever the umask, before SQLite
    opens it: prompts, outputs, batch files and digests of API keys are inside. SQLite gives
    its ``-wal`` and ``-shm`` files the main file's mode; older ones (0644 from an earlier
    version) are narrowed too, where this user owns them. (POSIX modes: not on Windows.)"""
    folder = path.parent
    if not folder.is_dir():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.name == "posix":
            os.chmod(folder, 0o700)  # mkdir's mode passes through the umask
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    if os.name != "posix":
        return
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            found = name.stat()
        except FileNotFoundError:
            continue
        if found.st_uid == os.geteuid() and stat.S_IMODE(found.st_mode) != 0o600:
            os.chmod(name, 0o600)


@contextlib.contextmanager
def write(db: Connection) -> Iterator[Connection]:
    """A write transaction on ``db``: committed at the end of the block, rolled back if it raises."""
    db.execute("BEGIN" if isinstance(db, _Postgres) else "BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


_TYPES = {"BLOB": "BYTEA", "REAL": "DOUBLE PRECISION"}


class _Postgres:
    """A psycopg connection (autocommit: :func:`write` opens transactions) that takes the
    stores' SQLite-flavoured SQL."""

    def __init__(self, url: str) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise ValueError("state_url needs psycopg: install ortserve-server[postgres]") from exc
        self._connection = psycopg.connect(url, autocommit=True)

    @staticmethod
    def _sql(sql: str) -> str:
        sql = sql.replace("?", "%s")
        return re.sub(r"\b(BLOB|REAL)\b", lambda m: _TYPES[m.group(1)], sql)

    def execute(self, sql: str, parameters: Sequence[Any] = (), /) -> Cursor:
        return self._connection.execute(self._sql(sql), parameters)

    def executemany(self, sql: str, parameters: Iterable[Sequence[Any]], /) -> object:
        with self._connection.cursor() as cursor:
            cursor.executemany(self._sql(sql), parameters)
        return None

    def close(self) -> None:
        self._connection.close()
