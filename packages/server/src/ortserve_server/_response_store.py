"""The bounded store behind ``store``/``previous_response_id`` of ``/v1/responses``, in the
state :class:`~._database.Database`: a SQLite file that outlives the process
(``ServerConfig.state_dir``), so a restart (an upgrade, a crash, a sidecar host restarting
it) keeps every stored response and the chains of agent clients that continue them; or an
in-memory database.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from ortserve_client import responses_protocol as rp

from ._database import Connection, Database, write

__all__ = ["ResponseStore", "StoredResponse"]

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
    the server without end: a put evicts entries until the new one fits, and a get of an
    expired entry finds nothing. Each belongs to its ``owner`` (the caller's API key digest,
    as files and batches do): another key finds nothing by its id. What a put evicts is the
    oldest entry of the key holding the most (entries, or bytes when those are the bound in
    the way): with the oldest of all going first, one key storing a response every few
    milliseconds evicted every other key's, breaking their ``previous_response_id`` chains;
    now it evicts its own once it holds the most. With one key it is the oldest of all."""

    def __init__(
        self, database: Database, max_entries: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._db = database
        self._clock = clock

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def put(
        self, owner: str, response: rp.Response, items: list[rp.InputItem], inherited: int
    ) -> concurrent.futures.Future[None] | None:
        """Keep ``response`` and its conversation (``items``, of which the first
        ``inherited`` are its previous response's); one larger than the byte bound is not
        kept. The write is queued (a later get sees it): the future is done once it is
        committed. Responses deleted since it began (``created_at``) are taken out of what it
        inherited, as the delete took them out of the responses already stored."""
        encoded = (msgspec.json.encode(response), msgspec.json.encode(items))
        size = len(encoded[0]) + len(encoded[1])
        if not self.enabled or size > self.max_bytes:
            return None
        now = self._clock()
        max_entries, max_bytes = self.max_entries, self.max_bytes
        # created_at is whole seconds: a deletion in that second may be older, and is then
        # already out of what the request read (applying it again changes nothing)
        began = response.created_at - 1

        def put(db: Connection) -> None:
            with write(db):
                db.execute("DELETE FROM responses WHERE expires <= ?", (now,))
                db.execute("DELETE FROM response_deletions WHERE deleted < ?", (now - _DELETIONS_KEPT,))
                deletions = db.execute(
                    "SELECT last_output_id, forgotten FROM response_deletions WHERE owner = ? AND deleted >= ?",
                    (owner, began),
                ).fetchall()
                blob = encoded[1]
                kept: int | None = inherited
                for last_output_id, forgotten in deletions:
                    blob, kept = _forget(blob, kept, last_output_id, set(_decode_ids(forgotten)))
                size = len(encoded[0]) + len(blob)
                row = (response.id, now, now + self.ttl, size, encoded[0], blob, owner, kept)
                db.execute("DELETE FROM responses WHERE id = ?", (row[0],))
                count, held = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM responses").fetchone()
                while count >= max_entries or held + size > max_bytes:
                    # The key holding the most of the bound in the way gives its oldest.
                    measure = "COUNT(*)" if count >= max_entries else "SUM(size)"
                    oldest = db.execute(
                        "SELECT id, size FROM responses WHERE owner = (SELECT owner FROM responses "
                        f"GROUP BY owner ORDER BY {measure} DESC LIMIT 1) ORDER BY created LIMIT 1"
                    ).fetchone()
                    if oldest is None:
                        break
                    db.execute("DELETE FROM responses WHERE id = ?", (oldest[0],))
                    count, held = count - 1, held - oldest[1]
                db.execute(
                    "INSERT INTO responses (id, created, expires, size, response, items, owner, inherited) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    row,
                )

        return self._db.submit(put)

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        now = self._clock()

        def get(db: Connection) -> StoredResponse | None:
            found = db.execute(
                "SELECT response, items, size, expires FROM responses WHERE id = ? AND owner = ? AND expires > ?",
                (response_id, owner, now),
            ).fetchone()
            if found is None:
                return None
            return StoredResponse(_decode_response(found[0]), _decode_items(found[1]), found[2], found[3])

        return await self._db.run(get)

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget a response: its row, and its own items (its input and output, not those it
        continued) in the responses that continued it, which hold a copy of them; those
        continue from then on without its turn. Its text was still listed and continued
        from after a delete (fourteenth probe, issue 45)."""
        now = self._clock()

        def delete(db: Connection) -> bool:
            with write(db):
                found = db.execute(
                    "SELECT items, inherited, response FROM responses WHERE id = ? AND owner = ? AND expires > ?",
                    (response_id, owner, now),
                ).fetchone()
                if found is None:
                    return False
                db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
                output = _decode_response(found[2]).output
                if output and isinstance(output[-1].id, str):
                    own = _decode_items(found[0])[found[1] or 0 :]
                    forgotten = sorted({item.id for item in own if isinstance(item.id, str)})
                    _forget_in_followers(db, owner, output[-1].id, set(forgotten))
                    # Kept for the responses still generating from it (stored after this).
                    db.execute(
                        "INSERT INTO response_deletions (owner, last_output_id, forgotten, deleted) "
                        "VALUES (?, ?, ?, ?)",
                        (owner, output[-1].id, msgspec.json.encode(forgotten), now),
                    )
                return True

        return await self._db.run(delete)


_DELETIONS_KEPT = 24 * 3600.0
"""How long a delete is remembered for the responses that were generating from the deleted
one: longer than any generation runs."""

_decode_ids = msgspec.json.Decoder(list[str]).decode


def _forget_in_followers(db: Connection, owner: str, last_output_id: str, forgotten: set[str]) -> None:
    """Remove the items with ids in ``forgotten`` from ``owner``'s responses that continued
    the deleted response whose last output item is ``last_output_id``."""
    rows = db.execute("SELECT id, items, inherited, size FROM responses WHERE owner = ?", (owner,)).fetchall()
    for follower, stored, inherited, size in rows:
        blob = bytes(stored)
        encoded, kept = _forget(blob, inherited, last_output_id, forgotten)
        if encoded is not blob:
            db.execute(
                "UPDATE responses SET items = ?, inherited = ?, size = ? WHERE id = ?",
                (encoded, kept, size - len(blob) + len(encoded), follower),
            )


def _forget(blob: bytes, inherited: int | None, last_output_id: str, forgotten: set[str]) -> tuple[bytes, int | None]:
    """A response's items (``blob``, of which the first ``inherited`` came from its previous
    response) without the items in ``forgotten`` if it continued the deleted response whose
    last output item is ``last_output_id`` (an id this server made: only the responses that
    continued it hold it); ``blob`` itself when it did not."""
    if msgspec.json.encode(last_output_id) not in blob:  # most did not: no need to decode them
        return blob, inherited
    items = _decode_items(blob)
    # Only what it inherited: its own input may reuse an id (fifteenth probe).
    cut = len(items) if inherited is None else inherited
    earlier = [item for item in items[:cut] if item.id not in forgotten]
    return msgspec.json.encode(earlier + items[cut:]), None if inherited is None else len(earlier)
