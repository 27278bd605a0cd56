"""``client.files`` and ``client.batches``: OpenAI's Files and Batch APIs on :class:`AsyncClient`."""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlencode

import msgspec

from . import batch_protocol as bp
from ._transport import Transport

__all__ = ["Batches", "Files", "batch_file"]

_encode_line = msgspec.json.Encoder().encode
_decode_line = msgspec.json.Decoder(bp.BatchOutputLine).decode


def batch_file(lines: Iterable[bp.BatchInputLine | Mapping[str, Any]]) -> bytes:
    """A batch's input file (JSONL) from its lines: Structs, or dicts with ``custom_id``,
    ``url`` and ``body`` (``method`` defaults to POST)."""
    out = []
    for line in lines:
        if not isinstance(line, bp.BatchInputLine):
            line = msgspec.convert({"method": "POST", **line}, bp.BatchInputLine)
        out.append(_encode_line(line))
    return b"\n".join(out) + b"\n"


def _query(**params: object) -> str:
    given = {key: value for key, value in params.items() if value is not None}
    return f"?{urlencode(given)}" if given else ""


class Files:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def create(
        self,
        *,
        file: bytes | str | os.PathLike[str] | tuple[str, bytes],
        purpose: Literal["batch"] = "batch",
    ) -> bp.FileObject:
        """``POST /files``: ``file`` as bytes (see :func:`batch_file`), a path, or (name, bytes)."""
        if isinstance(file, tuple):
            filename, data = file
        elif isinstance(file, bytes):
            filename, data = "batch.jsonl", file
        else:
            path = Path(file)
            filename, data = path.name, path.read_bytes()
        url = f"{self._transport.base_url}/files"
        response = await self._transport.response(
            "POST", url, None, stream=False, form=({"purpose": purpose}, {"file": (filename, data)})
        )
        return msgspec.json.decode(response.content, type=bp.FileObject)

    async def retrieve(self, file_id: str) -> bp.FileObject:
        return await self._transport.send("GET", f"{self._transport.base_url}/files/{file_id}", None, bp.FileObject)

    async def list(
        self, *, purpose: str | None = None, limit: int | None = None, after: str | None = None
    ) -> bp.FileList:
        url = f"{self._transport.base_url}/files{_query(purpose=purpose, limit=limit, after=after)}"
        return await self._transport.send("GET", url, None, bp.FileList)

    async def content(self, file_id: str) -> bytes:
        url = f"{self._transport.base_url}/files/{file_id}/content"
        response = await self._transport.response("GET", url, None, stream=False)
        return response.content

    async def results(self, file_id: str) -> builtins.list[bp.BatchOutputLine]:
        """A batch's output or error file, line by line."""
        return [_decode_line(line) for line in (await self.content(file_id)).splitlines() if line.strip()]

    async def delete(self, file_id: str) -> bp.FileDeleted:
        return await self._transport.send("DELETE", f"{self._transport.base_url}/files/{file_id}", None, bp.FileDeleted)


class Batches:
    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    async def create(
        self,
        *,
        input_file_id: str,
        endpoint: str,
        completion_window: Literal["24h"] = "24h",
        metadata: Mapping[str, str] | None = None,
    ) -> bp.Batch:
        body = bp.BatchCreateRequest(
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            metadata=dict(metadata) if metadata is not None else None,
        )
        return await self._transport.send("POST", f"{self._transport.base_url}/batches", body, bp.Batch)

    async def retrieve(self, batch_id: str) -> bp.Batch:
        return await self._transport.send("GET", f"{self._transport.base_url}/batches/{batch_id}", None, bp.Batch)

    async def list(self, *, limit: int | None = None, after: str | None = None) -> bp.BatchList:
        url = f"{self._transport.base_url}/batches{_query(limit=limit, after=after)}"
        return await self._transport.send("GET", url, None, bp.BatchList)

    async def cancel(self, batch_id: str) -> bp.Batch:
        return await self._transport.send(
            "POST", f"{self._transport.base_url}/batches/{batch_id}/cancel", None, bp.Batch
        )
