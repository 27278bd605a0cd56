"""The bounded in-memory store behind ``store``/``previous_response_id`` of ``/v1/responses``."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from ortserve_client import responses_protocol as rp

__all__ = ["ResponseStore", "StoredResponse"]


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
    get of an expired entry finds nothing. One process, one event loop: no locking."""

    def __init__(
        self, max_entries: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: rp.Response, items: list[rp.InputItem]) -> None:
        """Keep ``response`` and its conversation; one larger than the byte bound is not kept."""
        size = len(msgspec.json.encode(items)) + len(msgspec.json.encode(response))
        if not self.enabled or size > self.max_bytes:
            return
        self._expire()
        while self._entries and (len(self._entries) >= self.max_entries or self._bytes + size > self.max_bytes):
            self._drop(next(iter(self._entries)))
        self._entries[response.id] = StoredResponse(response, items, size, self._clock() + self.ttl)
        self._bytes += size

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        if response_id not in self._entries:
            return False
        self._drop(response_id)
        return True

    def _expire(self) -> None:
        # Insertion order is expiry order (one ttl for all), so the expired ones lead.
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now:
                break
            self._drop(oldest.response.id)

    def _drop(self, response_id: str) -> None:
        self._bytes -= self._entries.pop(response_id).size
