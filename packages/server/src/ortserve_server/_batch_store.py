"""Files and batches in the state :class:`~._database.Database`.

A batch's lines are rows of their own: a line is answered by one ``UPDATE ... WHERE status
IS NULL`` (its answer committed with it), and the output and error files are made from the
answered rows in one transaction. So a process killed at any point leaves each line either
answered once or not at all, and a restart runs exactly the lines without an answer.

Long on purpose (over 600 lines): files and batches are one store, as a batch's lines are
read from a file and its answers become files, each within one transaction of this module.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import secrets
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgspec
from ortserve_client import batch_protocol as bp

from ._database import Connection, Database, write
from ._ids import new_id

__all__ = ["FILE_PIECE", "OPEN", "RUNNER", "BatchStore", "NoRoomError", "PendingLine"]

OPEN = ("validating", "in_progress", "finalizing", "cancelling")
"""The statuses of a batch that is not over: the runner picks these up (again, after a restart)."""

FILE_PIECE = 1024 * 1024
"""The bytes of a file written to or read from the database at a time."""

_decode_batch = msgspec.json.Decoder(bp.Batch).decode
_encode = msgspec.json.encode


@dataclass(frozen=True, slots=True)
class PendingLine:
    line: int
    """Its number in the input file, from 1."""
    custom_id: str
    request: bytes
    """The body to send (JSON)."""
    started: int = 1
    """How many times it was started, this one included (earlier ones ended with the process)."""


def _file(row: Sequence[object]) -> bp.FileObject:
    file_id, purpose, filename, size, created, expires = row
    return bp.FileObject(
        id=str(file_id),
        purpose=str(purpose),
        filename=str(filename),
        bytes=int(size),  # type: ignore[call-overload]
        created_at=int(created),  # type: ignore[call-overload]
        expires_at=None if expires is None else int(expires),  # type: ignore[call-overload]
    )


_FILE_COLUMNS = "id, purpose, filename, bytes, created, expires"


class NoRoomError(Exception):
    """A file or batch that would take the store past its bound, or its owner past its
    share; the message says which (the API answers 413 with it)."""


class BatchStore:
    """Files (by owner: the caller's API key digest) and batches with their lines."""

    def __init__(self, database: Database, max_bytes: int, ttl: float, owners: int = 1) -> None:
        self._db = database
        self.max_bytes = max_bytes
        """Bytes of files and batch lines kept at most (uploads, lines and results alike)."""
        self.share = max_bytes // max(1, owners)
        """What one owner may hold of them (an equal share among the server's API keys), so
        that no key's uploads fill the room the others' need (fifth probe of issue 45)."""
        self.ttl = ttl
        """Seconds a file is kept after it was made, and a batch that is over."""
        self._deleted: collections.OrderedDict[tuple[str, str], tuple[float, str]] = collections.OrderedDict()
        """Where the last files deleted were, by (owner, id): a list's ``after`` may name one
        (the SDK's ``for f in client.files.list(limit=2): client.files.delete(f.id)`` pages on
        from the file it just deleted: twenty-fifth probe, issue 45). This process's deletions."""
        self._reading: collections.Counter[str] = collections.Counter()
        """Downloads under way in this process, by file id; changed on the database's thread
        only (see :meth:`open_file`)."""
        self.intake = anyio.Lock()
        """Held while a batch is made from its input file: the file, its checked lines and
        their bodies are in memory together (~2.5 times the file), so batches are made one
        at a time (four at once from a 95 MiB file grew the process 1.2 GiB)."""

    # -- files -------------------------------------------------------------------------------

    async def add_file(self, owner: str, purpose: str, filename: str, content: bytes) -> bp.FileObject:
        """Keep ``content``; :class:`NoRoomError` when it would take the files past
        ``max_bytes``, or ``owner``'s past its ``share``."""
        now = time.time()
        row = (new_id("file-"), owner, purpose, filename, len(content), now, now + self.ttl)

        def add(db: Connection) -> bp.FileObject:
            with write(db):
                self._drop_expired_files(db, now)
                _forget_old_batches(db, now - self.ttl)
                self._check_room(db, owner, len(content))
                if isinstance(db, sqlite3.Connection):
                    # Written a piece at a time: SQLite's binding copied a 90 MiB value in one
                    # call that held the GIL, so the event loop, 70-90 ms.
                    added = db.execute(
                        "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, zeroblob(?))", (*row, len(content))
                    )
                    assert added.lastrowid is not None
                    with db.blobopen("files", "content", added.lastrowid) as blob:
                        whole = memoryview(content)
                        for start in range(0, len(content), FILE_PIECE):
                            blob.write(whole[start : start + FILE_PIECE])
                else:
                    db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?)", (*row, content))
            return _file((row[0], purpose, filename, len(content), now, row[6]))

        return await self._db.run(add)

    async def file(self, owner: str, file_id: str) -> bp.FileObject | None:
        return await self._db.run(functools.partial(_find_file, owner=owner, file_id=file_id))

    async def open_file(self, owner: str, file_id: str) -> tuple[bp.FileObject, AsyncIterator[bytes]] | None:
        """The owner's file ``file_id`` and its content, read :data:`FILE_PIECE` bytes at a
        time: a download holds a piece, not the file (four downloads of a 95 MiB file at once
        grew the process 467 MiB and held ``/health`` 350 ms). ``None`` if there is none.

        The content is read whole even when the file is deleted or expires meanwhile, as a
        file unlinked while it is open lives on until it is closed: the delete hides it at
        once, and its row goes when the last download ends (twenty-seventh probe, issue 45:
        the answer ended short of its Content-Length, and the server logged a traceback for
        each such download). A delete by another process sharing the database does not know
        of this one's downloads: those still end short."""

        def find(db: Connection) -> bp.FileObject | None:
            found = _find_file(db, owner, file_id)
            if found is not None:
                self._reading[file_id] += 1  # with the look-up, so that no delete comes between
            return found

        found = await self._db.run(find)
        return None if found is None else (found, self._pieces(found))

    async def _pieces(self, file: bp.FileObject) -> AsyncIterator[bytes]:
        try:
            for start in range(0, file.bytes, FILE_PIECE):
                piece = await self._db.run(
                    functools.partial(_read_content, owner=None, file_id=file.id, start=start, size=FILE_PIECE)
                )
                if not piece:
                    return  # deleted by another process
                yield piece
        finally:
            # Queued, not awaited: a download cut off (its task cancelled) still lets go.
            self._db.submit(functools.partial(self._done_reading, file_id=file.id))

    def _done_reading(self, db: Connection, file_id: str) -> None:
        self._reading[file_id] -= 1
        if self._reading[file_id] <= 0:
            del self._reading[file_id]
            with write(db):
                db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, _UNLINKED))

    def _drop_expired_files(self, db: Connection, now: float) -> None:
        """Drop the files expired by ``now``, but those being downloaded (and deleted ones
        whose last download has not ended): :meth:`open_file`'s downloads end whole."""
        reading = list(self._reading)
        spare = f" AND id NOT IN ({', '.join('?' * len(reading))})" if reading else ""
        db.execute(f"DELETE FROM files WHERE expires <= ?{spare}", (now, *reading))

    async def file_content(self, owner: str, file_id: str) -> bytes | None:
        """The whole content of the owner's file ``file_id``; ``None`` if there is none."""
        return await self._db.run(functools.partial(_read_content, owner=owner, file_id=file_id, start=0, size=None))

    async def delete_file(self, owner: str, file_id: str) -> bool:
        def delete(db: Connection) -> bool:
            with write(db):
                found = db.execute("SELECT created FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
                if self._reading[file_id]:  # hidden from its owner; the last download removes it
                    db.execute("UPDATE files SET owner = ? WHERE id = ? AND owner = ?", (_UNLINKED, file_id, owner))
                else:
                    db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner))
            if found is not None:
                self._deleted[owner, file_id] = (found[0], file_id)
                while len(self._deleted) > _DELETED_KEPT:
                    self._deleted.popitem(last=False)
            return found is not None

        return await self._db.run(delete)

    async def files(
        self, owner: str, purpose: str | None, limit: int, after: str | None, *, newest_first: bool = True
    ) -> list[bp.FileObject] | None:
        """The owner's files, newest first (or oldest first); ``after``: those that come
        after that file in that order (``None`` when it is none of the owner's files)."""
        beyond, direction = ("<", "DESC") if newest_first else (">", "ASC")

        def listed(db: Connection) -> list[bp.FileObject] | None:
            cursor = None
            if after is not None:
                row = db.execute("SELECT created, id FROM files WHERE id = ? AND owner = ?", (after, owner)).fetchone()
                cursor = tuple(row) if row is not None else self._deleted.get((owner, after))
                if cursor is None:
                    return None
            query = f"SELECT {_FILE_COLUMNS} FROM files WHERE owner = ? AND expires > ?"
            args: list[object] = [owner, time.time()]
            if purpose is not None:
                query += " AND purpose = ?"
                args.append(purpose)
            if cursor is not None:
                # The cursor is one of the owner's files (or was): another key's id is
                # answered as an unknown one is, not with the owner's files older than it.
                query += f" AND (created, id) {beyond} (?, ?)"
                args += list(cursor)
            order = f" ORDER BY created {direction}, id {direction} LIMIT ?"
            rows = db.execute(query + order, (*args, limit)).fetchall()
            return [_file(row) for row in rows]

        return await self._db.run(listed)

    # -- batches -----------------------------------------------------------------------------

    async def create_batch(
        self,
        owner: str,
        scope: str | None,
        batch: bp.Batch,
        lines: list[tuple[str, bytes]],
        trace: str | None = None,
    ) -> None:
        """Keep ``batch`` and its lines (custom id, request body), in one transaction;
        :class:`NoRoomError` when they would take the files and batches past ``max_bytes``,
        or ``owner``'s past its ``share``. Batches
        over for longer than ``ttl`` go first, with their lines. ``trace``: the W3C
        ``traceparent`` its lines' spans continue (the creating request's span)."""
        rows = [(batch.id, number, custom_id, body) for number, (custom_id, body) in enumerate(lines, 1)]
        size = sum(len(body) for _, body in lines)

        def create(db: Connection) -> None:
            with write(db):
                _forget_old_batches(db, time.time() - self.ttl)
                self._check_room(db, owner, size)
                db.execute(
                    "INSERT INTO batches (id, owner, created, status, scope, batch, trace) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (batch.id, owner, batch.created_at, batch.status, scope, _encode(batch), trace),
                )
                db.executemany("INSERT INTO batch_lines (batch_id, line, custom_id, request) VALUES (?, ?, ?, ?)", rows)

        await self._db.run(create)

    def _check_room(self, db: Connection, owner: str, size: int) -> None:
        # Says what holds the room: a key whose ended batches held it was told to delete its
        # files when it had none (twenty-seventh probe, issue 45).
        files, lines = _held_bytes(db)
        if files + lines + size > self.max_bytes:
            raise NoRoomError(
                f"the server's room for files and batches ({self.max_bytes} bytes) is full: {files} bytes in "
                f"files, {lines} in batches still running; delete files or wait for them to expire"
            )
        files, lines = _held_bytes(db, owner)
        if self.share < self.max_bytes and files + lines + size > self.share:
            raise NoRoomError(
                f"this API key's share of the server's room for files and batches ({self.share} bytes) is full: "
                f"{files} bytes in its files, {lines} in its batches still running; delete its files (a batch's "
                "output and error files among them), wait for them to expire or for its batches to end"
            )

    async def batch(self, owner: str | None, batch_id: str) -> bp.Batch | None:
        """The batch (its counts as they are now); ``owner`` ``None``: whoever owns it."""

        def get(db: Connection) -> bp.Batch | None:
            query = "SELECT batch FROM batches WHERE id = ?" + ("" if owner is None else " AND owner = ?")
            found = db.execute(query, (batch_id,) if owner is None else (batch_id, owner)).fetchone()
            return None if found is None else _counted(db, _decode_batch(found[0]))

        return await self._db.run(get)

    async def batches(self, owner: str, limit: int, after: str | None) -> list[bp.Batch] | None:
        """The owner's batches, newest first; ``after`` as for :meth:`files`."""

        def listed(db: Connection) -> list[bp.Batch] | None:
            if after is not None and not _owned(db, "batches", after, owner):
                return None
            query = "SELECT batch FROM batches WHERE owner = ?"
            args: list[object] = [owner]
            if after is not None:
                query += " AND (created, id) < (SELECT created, id FROM batches WHERE id = ? AND owner = ?)"
                args += [after, owner]
            rows = db.execute(query + " ORDER BY created DESC, id DESC LIMIT ?", (*args, limit)).fetchall()
            return [_counted(db, _decode_batch(row[0])) for row in rows]

        return await self._db.run(listed)

    async def open_batches(self) -> list[tuple[bp.Batch, str, str | None, str | None]]:
        """Batches not over, oldest first, with their owner, prefix-cache scope and trace
        context (a ``traceparent``, or ``None``)."""

        def listed(db: Connection) -> list[tuple[bp.Batch, str, str | None, str | None]]:
            marks = ", ".join("?" * len(OPEN))
            rows = db.execute(
                f"SELECT batch, owner, scope, trace FROM batches WHERE status IN ({marks}) ORDER BY created, id", OPEN
            ).fetchall()
            return [(_decode_batch(row[0]), row[1], row[2], row[3]) for row in rows]

        return await self._db.run(listed)

    async def claim(self, batch_id: str, runner: str, lease: float) -> bool:
        """Whether ``runner`` may run the batch for the next ``lease`` seconds (renewed by
        claiming again): no other runner holds it, its lease ran out, or it was held by a
        process of this machine that is gone (a server restarted after a crash takes its
        batches back at once)."""

        def claim(db: Connection) -> bool:
            now = time.time()
            with write(db):
                found = db.execute("SELECT runner, lease FROM batches WHERE id = ?", (batch_id,)).fetchone()
                if found is None:
                    return False
                holder, until = found
                if holder not in (None, runner) and until is not None and until > now and _alive(holder):
                    return False
                db.execute("UPDATE batches SET runner = ?, lease = ? WHERE id = ?", (runner, now + lease, batch_id))
                return True

        return await self._db.run(claim)

    async def update_batch(self, batch: bp.Batch, *, unless: Sequence[str] = ()) -> bool:
        """Store ``batch`` as it is now, unless its stored status is in ``unless`` (a cancel
        that came meanwhile wins over the runner's step); whether it was stored."""

        def update(db: Connection) -> bool:
            with write(db):
                status = db.execute("SELECT status FROM batches WHERE id = ?", (batch.id,)).fetchone()
                if status is None or status[0] in unless:
                    return False
                db.execute(
                    "UPDATE batches SET status = ?, batch = ? WHERE id = ?", (batch.status, _encode(batch), batch.id)
                )
                return True

        return await self._db.run(update)

    async def pending_lines(self, batch_id: str, limit: int, skip: set[int]) -> list[PendingLine]:
        """Lines without an answer, in order, but those in ``skip`` (running now), each
        counted as started once more.

        A line started before but not answered (the server ended while it ran, or stopped
        it) is a suspect: the process may have died of it or of a line beside it. Suspects
        come first, each alone: one when nothing runs (``skip`` empty), none while something
        does, so that a line that kills the server dies alone and only its own count grows;
        the lines that ran beside it are answered when they run alone in turn (seventeenth
        probe: three crashes of one line also ended the seven running beside it)."""

        def pending(db: Connection) -> list[PendingLine]:
            with write(db):
                suspects = [
                    line
                    for (line,) in db.execute(
                        "SELECT line FROM batch_lines WHERE batch_id = ? AND status IS NULL AND started > 0"
                        " ORDER BY line",
                        (batch_id,),
                    ).fetchall()
                    if line not in skip
                ]
                if suspects:
                    if skip:
                        return []  # it waits for the lines running now to end
                    rows: Iterable[Any] = db.execute(
                        "SELECT line, custom_id, request, started FROM batch_lines WHERE batch_id = ? AND line = ?",
                        (batch_id, suspects[0]),
                    )
                else:
                    rows = db.execute(
                        "SELECT line, custom_id, request, started FROM batch_lines WHERE batch_id = ?"
                        " AND status IS NULL AND started = 0 ORDER BY line",
                        (batch_id,),
                    )
                found = []
                for line, custom_id, request, started in rows:
                    if line not in skip:
                        found.append(PendingLine(line, custom_id, bytes(request), int(started) + 1))
                        if len(found) == limit:
                            break
                db.executemany(
                    "UPDATE batch_lines SET started = started + 1 WHERE batch_id = ? AND line = ?",
                    [(batch_id, line.line) for line in found],
                )
                return found

        return await self._db.run(pending)

    async def unstart(self, batch_id: str, lines: Sequence[int]) -> None:
        """Take back a start of each of ``lines`` still unanswered: this process stopped them
        itself (a shutdown, a cancel, an expiry), so they did not end it, and counted they
        would run again one at a time as suspects (:meth:`pending_lines`)."""

        def update(db: Connection) -> None:
            with write(db):
                db.executemany(
                    "UPDATE batch_lines SET started = started - 1"
                    " WHERE batch_id = ? AND line = ? AND status IS NULL AND started > 0",
                    [(batch_id, line) for line in lines],
                )

        await self._db.run(update)

    async def answer(self, batch_id: str, line: int, status: int, answer: bp.BatchOutputLine) -> bool:
        """Record line ``line``'s answer (``status``: its HTTP status, 0 for a line never
        run); ``False`` when it already had one (it is never answered twice)."""
        encoded = _encode(answer)

        def record(db: Connection) -> bool:
            with write(db):
                return (
                    db.execute(
                        "UPDATE batch_lines SET status = ?, answer = ? WHERE batch_id = ? AND line = ?"
                        " AND status IS NULL",
                        (status, encoded, batch_id, line),
                    ).rowcount
                    > 0
                )

        return await self._db.run(record)

    async def close_lines(self, batch_id: str, code: str, message: str) -> None:
        """Answer every line without an answer with ``error`` ``code`` (an expired or cancelled batch)."""

        def close(db: Connection) -> None:
            with write(db):
                rows = db.execute(
                    "SELECT line, custom_id FROM batch_lines WHERE batch_id = ? AND status IS NULL", (batch_id,)
                ).fetchall()
                db.executemany(
                    "UPDATE batch_lines SET status = 0, answer = ? WHERE batch_id = ? AND line = ?",
                    [
                        (
                            _encode(
                                bp.BatchOutputLine(
                                    id=new_id("batch_req_"),
                                    custom_id=custom_id,
                                    response=None,
                                    error=bp.LineError(code=code, message=message),
                                )
                            ),
                            batch_id,
                            line,
                        )
                        for line, custom_id in rows
                    ],
                )

        await self._db.run(close)

    async def finish(self, batch: bp.Batch, owner: str) -> bp.Batch:
        """Make the output file (2xx answers) and the error file (the others), in line order,
        and store ``batch`` with their ids and final counts, all in one transaction."""
        now = time.time()

        def finish(db: Connection) -> bp.Batch:
            with write(db):
                done = _counted(db, batch)
                for kind, file_id in _write_answer_files(db, batch.id, owner, now, now + self.ttl).items():
                    if kind == "output":
                        done.output_file_id = file_id
                    else:
                        done.error_file_id = file_id
                db.execute(
                    "UPDATE batches SET status = ?, batch = ? WHERE id = ?", (done.status, _encode(done), done.id)
                )
                _drop_spent_lines(db, "batch_id = ?", (done.id,))
                return done

        return await self._db.run(finish)


RUNNER = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
"""This process's name as a batch runner."""


def _write_answer_files(db: Connection, batch_id: str, owner: str, now: float, expires: float) -> dict[str, str]:
    """Store the batch's answered lines, in line order, as its ``output`` file (2xx answers)
    and ``error`` file (the others): ``{kind: file id}`` for each that has a line.

    SQLite's files are written a piece at a time through an incremental blob handle, which
    lets go of the GIL while it writes: joined into one value, a 140 MB output file held
    every other thread (the event loop too) 82 ms while it was copied, and the process held
    the answers twice over. PostgreSQL takes the joined value."""
    answered = "FROM batch_lines WHERE batch_id = ? AND status IS NOT NULL ORDER BY line"
    sizes = {"output": 0, "error": 0}
    for status, length in db.execute(f"SELECT status, length(answer) {answered}", (batch_id,)).fetchall():
        sizes[_answer_kind(status)] += length + 1  # and its newline
    ids = {kind: new_id("file-") for kind, size in sizes.items() if size}
    add = "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, {})"
    if not isinstance(db, sqlite3.Connection):
        joined: dict[str, list[bytes]] = {kind: [] for kind in ids}
        for status, answer in db.execute(f"SELECT status, answer {answered}", (batch_id,)):
            joined[_answer_kind(status)].append(bytes(answer))
        for kind, file_id in ids.items():
            about = (file_id, owner, "batch_output", f"{batch_id}_{kind}.jsonl", sizes[kind], now, expires)
            db.execute(add.format("?"), (*about, b"\n".join(joined[kind]) + b"\n"))
        return ids
    with contextlib.ExitStack() as opened:
        blobs: dict[str, sqlite3.Blob] = {}
        for kind, file_id in ids.items():
            about = (file_id, owner, "batch_output", f"{batch_id}_{kind}.jsonl", sizes[kind], now, expires)
            rowid = db.execute(add.format("zeroblob(?)"), (*about, sizes[kind])).lastrowid
            assert rowid is not None  # an INSERT's
            blobs[kind] = opened.enter_context(db.blobopen("files", "content", rowid))
        pieces = {kind: bytearray() for kind in ids}
        for status, answer in db.execute(f"SELECT status, answer {answered}", (batch_id,)):
            kind = _answer_kind(status)
            piece = pieces[kind]
            piece += answer
            piece += b"\n"
            if len(piece) >= FILE_PIECE:
                blobs[kind].write(piece)
                piece.clear()
        for kind, piece in pieces.items():
            blobs[kind].write(piece)
    return ids


def _answer_kind(status: int) -> str:
    """The file a line's answer goes to, by its HTTP status (0: never run)."""
    return "output" if 200 <= status < 300 else "error"


def _alive(runner: str) -> bool:
    """Whether the runner ``runner`` may still be running: always for another machine's
    (its lease says), else whether its process is there."""
    host, _, rest = runner.partition(":")
    if host != socket.gethostname():
        return True
    try:
        os.kill(int(rest.partition(":")[0]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):
        return True
    return True


def _held_bytes(db: Connection, owner: str | None = None) -> tuple[int, int]:
    """Bytes of files, and of batches' lines (their requests and answers: an ended batch's
    lines hold none, :func:`_drop_spent_lines`), kept now, of ``owner`` (``None``: of everyone)."""
    lines = "SELECT COALESCE(SUM(LENGTH(request)), 0) + COALESCE(SUM(LENGTH(answer)), 0) FROM batch_lines"
    if owner is None:
        files = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files").fetchone()[0]
        held = db.execute(lines).fetchone()[0]
    else:
        files = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner = ?", (owner,)).fetchone()[0]
        held = db.execute(lines + " WHERE batch_id IN (SELECT id FROM batches WHERE owner = ?)", (owner,)).fetchone()[0]
    return int(files), int(held)


def _drop_spent_lines(db: Connection, where: str, args: Sequence[object]) -> None:
    """Empty the request bodies and answers of the lines ``where`` says, of batches that
    ended: nothing reads them again (a line runs only while its batch is open, and its
    answer is in the batch's output or error file; the counts are read from the lines'
    statuses), and they held the owner's share of the room for ``files_ttl``, 30 days,
    with no route to delete a batch (twenty-seventh probe, issue 45: a key with no file
    left was refused its fifth batch of 96 MB)."""
    db.execute(f"UPDATE batch_lines SET request = ?, answer = NULL WHERE {where}", (b"", *args))


def _forget_old_batches(db: Connection, before: float) -> None:
    """Drop batches made before ``before`` that are over, with their lines (their output
    and error files expire as files do), and empty the lines of any that are over."""
    marks = ", ".join("?" * len(OPEN))
    old = [
        row[0]
        for row in db.execute(
            f"SELECT id FROM batches WHERE created < ? AND status NOT IN ({marks})", (before, *OPEN)
        ).fetchall()
    ]
    db.executemany("DELETE FROM batch_lines WHERE batch_id = ?", [(batch_id,) for batch_id in old])
    db.executemany("DELETE FROM batches WHERE id = ?", [(batch_id,) for batch_id in old])
    # Those of batches that an earlier version ended (it kept them).
    _drop_spent_lines(
        db,
        f"(LENGTH(request) > 0 OR answer IS NOT NULL) AND batch_id IN (SELECT id FROM batches WHERE status NOT IN ({marks}))",
        OPEN,
    )


def _counted(db: Connection, batch: bp.Batch) -> bp.Batch:
    """``batch`` with its request counts read from its lines."""
    total, completed, failed = db.execute(
        "SELECT COUNT(*), COUNT(CASE WHEN status BETWEEN 200 AND 299 THEN 1 END),"
        " COUNT(CASE WHEN status NOT BETWEEN 200 AND 299 THEN 1 END)"
        " FROM batch_lines WHERE batch_id = ?",
        (batch.id,),
    ).fetchone()
    batch.request_counts = bp.BatchRequestCounts(total=total, completed=completed, failed=failed)
    return batch


def _find_file(db: Connection, owner: str, file_id: str) -> bp.FileObject | None:
    found = db.execute(
        f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ? AND owner = ? AND expires > ?", (file_id, owner, time.time())
    ).fetchone()
    return None if found is None else _file(found)


def _read_content(db: Connection, owner: str | None, file_id: str, start: int, size: int | None) -> bytes | None:
    """``size`` bytes (``None``: all) of the owner's file ``file_id`` from ``start``;
    ``None`` if there is no such file (or it expired). ``owner`` ``None``: the file by its
    id alone, deleted or expired meanwhile (a download under way: :meth:`BatchStore.open_file`).
    On SQLite through an incremental blob handle, whose reads let go of the GIL: a
    ``SELECT`` of the content converts the value holding it (a 60 MiB file: 60 ms of the
    event loop's turns), and ``substr`` reads the whole value for each piece (a 95 MiB
    file's pieces took 10 s). PostgreSQL reads a slice itself."""
    where, mine = (
        ("id = ?", (file_id,))
        if owner is None
        else ("id = ? AND owner = ? AND expires > ?", (file_id, owner, time.time()))
    )
    if isinstance(db, sqlite3.Connection):
        rowid = db.execute(f"SELECT rowid FROM files WHERE {where}", mine).fetchone()
        if rowid is None:
            return None
        with db.blobopen("files", "content", rowid[0], readonly=True) as blob:
            blob.seek(start)
            return blob.read(-1 if size is None else size)
    if size is None:
        found = db.execute(f"SELECT content FROM files WHERE {where}", mine)
    else:
        found = db.execute(f"SELECT substr(content, ?, ?) FROM files WHERE {where}", (start + 1, size, *mine))  # from 1
    row = found.fetchone()
    return None if row is None or row[0] is None else bytes(row[0])


_UNLINKED = "(deleted)"
"""The owner of a file deleted while it was being downloaded, until the last download ends:
no caller's (owners are SHA-256 digests in hex, or empty)."""


_DELETED_KEPT = 10_000
"""Deleted files whose place a list's cursor may still name."""


def _owned(db: Connection, table: Literal["files", "batches"], object_id: str, owner: str) -> bool:
    """Whether ``object_id`` is one of ``owner``'s rows of ``table``: a paging cursor that is
    not is a 400 (twenty-third probe, issue 45: it listed nothing, answered 200)."""
    return db.execute(f"SELECT 1 FROM {table} WHERE id = ? AND owner = ?", (object_id, owner)).fetchone() is not None
