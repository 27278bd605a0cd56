"""The web page's conversations in the state :class:`~._database.Database`, per owner (the
caller's API key digest, as files and batches): another key finds nothing by an id, and
no list, search or export shows it. Bounded per owner in count and per conversation in
bytes, so that no caller grows the database without end."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from ortserve_client import conversations_protocol as cp

from ._database import Connection, Database, write
from ._ids import new_id

__all__ = [
    "MAX_CONVERSATIONS",
    "MAX_CONVERSATION_BYTES",
    "MAX_OWNER_BYTES",
    "ConversationStore",
    "ConversationTooLarge",
    "ConversationsFull",
    "summary",
]

MAX_CONVERSATIONS = 1000
"""Conversations one owner may keep."""
MAX_CONVERSATION_BYTES = 8 * 1024 * 1024
"""The largest conversation (its JSON, inline images included)."""
MAX_OWNER_BYTES = 128 * 1024 * 1024
"""The JSON of all the conversations one owner may keep (16 of the largest); their search
text is stored beside it, up to as much again. 1,000 of 8 MiB were 16 GiB with it, in the
server's memory where the state is (``state_dir`` None, a mounted app's default): 60 of
7 MiB grew it 970 MiB, and 36 of them (256 MiB of JSON) still 609 MiB."""


class _Body(msgspec.Struct, kw_only=True):
    """What a conversation's ``body`` column holds."""

    system: str = ""
    settings: cp.ConversationSettings = msgspec.field(default_factory=cp.ConversationSettings)
    messages: list[cp.ConversationMessage] = msgspec.field(default_factory=list)


_decode_body = msgspec.json.Decoder(_Body).decode
_encode = msgspec.json.encode
_COLUMNS = "id, title, model, created, updated, message_count"


class ConversationsFull(Exception):
    """The owner already keeps :data:`MAX_CONVERSATIONS`, or :data:`MAX_OWNER_BYTES`."""


def _check_room(db: Connection, owner: str, adding: int, replacing: str | None = None) -> None:
    """Raise :class:`ConversationsFull` unless the owner's conversations, with ``adding``
    bytes more (in place of conversation ``replacing``'s), stay within :data:`MAX_OWNER_BYTES`."""
    query = "SELECT COALESCE(SUM(size), 0) FROM ui_conversations WHERE owner = ?"
    args: tuple[str, ...] = (owner,)
    if replacing is not None:
        query += " AND id <> ?"
        args = (owner, replacing)
    (held,) = db.execute(query, args).fetchone()
    if int(held) + adding > MAX_OWNER_BYTES:
        raise ConversationsFull(
            f"a key keeps at most {MAX_OWNER_BYTES} bytes of conversations; it holds {int(held)}, and this "
            f"adds {adding}: delete some first"
        )


class ConversationTooLarge(Exception):
    """A conversation's JSON is larger than :data:`MAX_CONVERSATION_BYTES`."""


def _searchable(title: str, messages: Sequence[cp.ConversationMessage]) -> str:
    """The title and the messages' text, case-folded (SQLite's LOWER folds ASCII only)."""
    texts = [title]
    for message in messages:
        if isinstance(message.content, str):
            texts.append(message.content)
        else:
            texts.extend(str(part.get("text", "")) for part in message.content if part.get("type") == "text")
    return "\n".join(texts).casefold()


def _summary(row: Sequence[object]) -> cp.ConversationSummary:
    conversation_id, title, model, created, updated, count = row
    return cp.ConversationSummary(
        id=str(conversation_id),
        title=str(title),
        model=str(model),
        created_at=float(created),  # type: ignore[arg-type]
        updated_at=float(updated),  # type: ignore[arg-type]
        message_count=int(count),  # type: ignore[call-overload]
    )


def summary(conversation: cp.Conversation) -> cp.ConversationSummary:
    """``conversation`` as a list shows it."""
    return cp.ConversationSummary(
        id=conversation.id,
        title=conversation.title,
        model=conversation.model,
        message_count=len(conversation.messages),
        created_at=conversation.created_at,
        updated_at=conversation.updated_at,
    )


class ConversationStore:
    """Conversations by owner and id."""

    def __init__(self, database: Database) -> None:
        self._db = database

    async def create(self, owner: str, *writes: cp.ConversationWrite) -> list[cp.Conversation]:
        """New conversations from ``writes`` (absent fields empty; an imported one keeps its
        timestamps), all or none: ``ConversationsFull`` or ``ConversationTooLarge`` when
        they cannot be kept."""
        if len(writes) > MAX_CONVERSATIONS:  # before the work of each (500,000 held the event loop 5 s)
            raise ConversationsFull(
                f"a key keeps at most {MAX_CONVERSATIONS} conversations; this import has {len(writes)}"
            )
        now = time.time()
        made = []
        for given in writes:
            created = getattr(given, "created_at", msgspec.UNSET)
            updated = getattr(given, "updated_at", msgspec.UNSET)
            empty = cp.Conversation(
                id=new_id("conv_"),
                title="",
                model="",
                system="",
                settings=cp.ConversationSettings(),
                messages=[],
                created_at=now if created is msgspec.UNSET else created,
                updated_at=now if updated is msgspec.UNSET else updated,
            )
            made.append(_merge(empty, given))
        rows = [_row(owner, conversation) for conversation in made]

        def create(db: Connection) -> None:
            with write(db):
                (count,) = db.execute("SELECT COUNT(*) FROM ui_conversations WHERE owner = ?", (owner,)).fetchone()
                if count + len(rows) > MAX_CONVERSATIONS:
                    raise ConversationsFull(f"a key keeps at most {MAX_CONVERSATIONS} conversations: delete some first")
                _check_room(db, owner, sum(int(row[7]) for row in rows))  # type: ignore[call-overload]
                db.executemany("INSERT INTO ui_conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)

        await self._db.run(create)
        return made

    async def get(self, owner: str, conversation_id: str) -> cp.Conversation | None:
        def get(db: Connection) -> cp.Conversation | None:
            found = db.execute(
                f"SELECT {_COLUMNS}, body FROM ui_conversations WHERE id = ? AND owner = ?", (conversation_id, owner)
            ).fetchone()
            return None if found is None else _conversation(found)

        return await self._db.run(get)

    async def update(self, owner: str, conversation_id: str, write_: cp.ConversationWrite) -> cp.Conversation | None:
        """The conversation with ``write_``'s fields replaced; ``None`` if the owner has no such id."""

        def update(db: Connection) -> cp.Conversation | None:
            with write(db):
                found = db.execute(
                    f"SELECT {_COLUMNS}, body FROM ui_conversations WHERE id = ? AND owner = ?",
                    (conversation_id, owner),
                ).fetchone()
                if found is None:
                    return None
                conversation = _merge(_conversation(found), write_)
                conversation.updated_at = time.time()
                row = _row(owner, conversation)
                _check_room(db, owner, int(row[7]), replacing=conversation_id)  # type: ignore[call-overload]
                db.execute(
                    "UPDATE ui_conversations SET title = ?, model = ?, updated = ?, message_count = ?, size = ?,"
                    " body = ?, text = ? WHERE id = ? AND owner = ?",
                    (*row[2:4], *row[5:], conversation_id, owner),
                )
                return conversation

        return await self._db.run(update)

    async def delete(self, owner: str, conversation_id: str) -> bool:
        def delete(db: Connection) -> bool:
            with write(db):
                query = "DELETE FROM ui_conversations WHERE id = ? AND owner = ?"
                return db.execute(query, (conversation_id, owner)).rowcount > 0

        return await self._db.run(delete)

    async def summaries(self, owner: str, limit: int, search: str | None = None) -> list[cp.ConversationSummary]:
        """The owner's conversations, most recently updated first; ``search``: those whose
        title or message text holds it (case-insensitive).

        A search reads one conversation's text a call, and Python's search finds the query:
        SQL's ``LIKE`` is a naive scan, and a query that nearly matched a key's 70 MiB of
        text took 42 s, holding the one database thread every key's stored responses,
        files and batches wait for (sixteenth probe, issue 45)."""

        def listed(db: Connection) -> list[tuple[Any, ...]]:
            query = f"SELECT {_COLUMNS} FROM ui_conversations WHERE owner = ? ORDER BY updated DESC, id"
            return list(db.execute(query + ("" if search else " LIMIT ?"), (owner,) if search else (owner, limit)))

        rows = await self._db.run(listed)
        if not search:
            return [_summary(row) for row in rows]
        query = search.casefold()  # as the stored text is
        found: list[cp.ConversationSummary] = []
        for row in rows:

            def holds(db: Connection, conversation_id: str = row[0]) -> bool:
                text = db.execute(
                    "SELECT text FROM ui_conversations WHERE id = ? AND owner = ?", (conversation_id, owner)
                ).fetchone()
                return text is not None and query in text[0]

            if await self._db.run(holds):
                found.append(_summary(row))
                if len(found) == limit:
                    break
        return found

    async def export(self, owner: str) -> AsyncIterator[cp.Conversation]:
        """Every conversation of the owner, whole, most recently updated first, one at a
        time (all of them at once are up to 1,000 times 8 MiB); one deleted meanwhile is left out."""

        def ids(db: Connection) -> list[str]:
            query = "SELECT id FROM ui_conversations WHERE owner = ? ORDER BY updated DESC, id"
            return [str(row[0]) for row in db.execute(query, (owner,))]

        for conversation_id in await self._db.run(ids):
            if (found := await self.get(owner, conversation_id)) is not None:
                yield found


def _merge(conversation: cp.Conversation, write_: cp.ConversationWrite) -> cp.Conversation:
    """``conversation`` with the fields ``write_`` gives."""
    changes = {
        name: getattr(write_, name)
        for name in ("title", "model", "system", "settings", "messages")
        if getattr(write_, name) is not msgspec.UNSET
    }
    return msgspec.structs.replace(conversation, **changes)


def _row(owner: str, conversation: cp.Conversation) -> tuple[object, ...]:
    body = _encode(_Body(system=conversation.system, settings=conversation.settings, messages=conversation.messages))
    if len(body) > MAX_CONVERSATION_BYTES:
        raise ConversationTooLarge(f"a conversation may hold at most {MAX_CONVERSATION_BYTES} bytes of JSON")
    return (
        conversation.id,
        owner,
        conversation.title,
        conversation.model,
        conversation.created_at,
        conversation.updated_at,
        len(conversation.messages),
        len(body),
        body,
        _searchable(conversation.title, conversation.messages),
    )


def _conversation(row: Sequence[object]) -> cp.Conversation:
    summary = _summary(row[:6])
    body = _decode_body(bytes(row[6]))  # type: ignore[call-overload]  # bytes, or psycopg's memoryview
    return cp.Conversation(
        id=summary.id,
        title=summary.title,
        model=summary.model,
        system=body.system,
        settings=body.settings,
        messages=body.messages,
        created_at=summary.created_at,
        updated_at=summary.updated_at,
    )
