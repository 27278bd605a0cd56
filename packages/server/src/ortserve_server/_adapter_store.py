"""LoRA adapters loaded over HTTP (``/v1/load_lora_adapter``), kept in the state
:class:`~._database.Database` so that a restart serves them again."""

from __future__ import annotations

import logging
import time

from ortserve_runtime import ModelLoadError, ModelRegistry

from ._database import Connection, Database, write

__all__ = ["AdapterStore"]

logger = logging.getLogger("ortserve.server")


class AdapterStore:
    """Adapters by (model, name) with the file each was loaded from."""

    def __init__(self, database: Database) -> None:
        self._db = database

    async def add(self, model: str, name: str, path: str) -> None:
        def add(db: Connection) -> None:
            with write(db):
                db.execute("DELETE FROM adapters WHERE model = ? AND name = ?", (model, name))
                db.execute("INSERT INTO adapters VALUES (?, ?, ?, ?)", (model, name, path, time.time()))

        await self._db.run(add)

    async def remove(self, model: str, name: str) -> None:
        def remove(db: Connection) -> None:
            with write(db):
                db.execute("DELETE FROM adapters WHERE model = ? AND name = ?", (model, name))

        await self._db.run(remove)

    async def restore(self, registry: ModelRegistry) -> list[str]:
        """Serve the kept adapters again; returns those that could not be (logged with the
        reason: a file gone, a model no longer served). They stay kept, so that a file back
        in place serves again at the next start; unloading one forgets it."""

        def kept(db: Connection) -> list[tuple[str, str, str]]:
            return db.execute("SELECT model, name, path FROM adapters ORDER BY created").fetchall()

        failed = []
        for model, name, path in await self._db.run(kept):
            if model not in registry.names():
                reason = f"model {model!r} is not served now"
            else:
                try:
                    await registry.add_adapter(model, name, path)
                    continue
                except (ModelLoadError, ValueError) as exc:
                    reason = str(exc)
            logger.error("LoRA adapter %s:%s (%s) is not served again after the restart: %s", model, name, path, reason)
            failed.append(f"{model}:{name}")
        return failed
