"""A local stand-in for the Hugging Face Hub: just the endpoints `huggingface_hub` uses to
download a model (repo info, HEAD/GET resolve with Range), with records of what it served."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class FakeHub:
    """Repos as ``{repo_id: {path: bytes}}``. ``drop_after`` makes the first GET of a file
    stop after that many bytes (a broken connection), to exercise resume; ``fail_get``
    answers every GET of a file with that status (a Hub outage after the HEAD);
    ``chunk_delay`` slows each 16 KiB chunk down, to catch a download in the middle.

    Records: ``ranges`` (path, Range header) per GET, ``bytes_sent`` per path, ``auth``
    (Authorization header) per request."""

    repos: dict[str, dict[str, bytes]]
    drop_after: dict[str, int] = field(default_factory=dict)
    fail_get: dict[str, int] = field(default_factory=dict)
    chunk_delay: float = 0.0
    ranges: list[tuple[str, str | None]] = field(default_factory=list)
    bytes_sent: dict[str, int] = field(default_factory=dict)
    auth: list[str | None] = field(default_factory=list)

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/api/models/{owner}/{name}/revision/{revision}", self.info),
                Route("/api/models/{owner}/{name}", self.info),
                Route("/{owner}/{name}/resolve/{revision}/{path:path}", self.resolve, methods=["GET", "HEAD"]),
            ]
        )

    def _repo(self, request: Request) -> tuple[str, dict[str, bytes] | None]:
        repo_id = f"{request.path_params['owner']}/{request.path_params['name']}"
        self.auth.append(request.headers.get("authorization"))
        return repo_id, self.repos.get(repo_id)

    async def info(self, request: Request) -> Response:
        repo_id, files = self._repo(request)
        if files is None:
            return _error(404, "RepoNotFound")
        if request.path_params.get("revision", "main") not in ("main", SHA):
            return _error(404, "RevisionNotFound")
        siblings = [{"rfilename": path, "size": len(data)} for path, data in files.items()]
        return JSONResponse({"id": repo_id, "modelId": repo_id, "sha": SHA, "siblings": siblings, "private": False})

    async def resolve(self, request: Request) -> Response:
        _, files = self._repo(request)
        if files is None:
            return _error(404, "RepoNotFound")
        if request.path_params["revision"] not in ("main", SHA):
            return _error(404, "RevisionNotFound")
        path = request.path_params["path"]
        data = files.get(path)
        if data is None:
            return _error(404, "EntryNotFound")
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        headers = {"X-Repo-Commit": SHA, "ETag": etag, "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return Response(headers={**headers, "Content-Length": str(len(data))})
        range_header = request.headers.get("range")
        self.ranges.append((path, range_header))
        if path in self.fail_get:
            return _error(self.fail_get[path], "InternalError")
        start = int(range_header.split("=")[1].split("-")[0]) if range_header else 0
        body = data[start:]
        limit = self.drop_after.pop(path, None)

        async def chunks() -> object:
            sent = 0
            for offset in range(0, len(body), 16384):
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
                piece = body[offset : offset + 16384]
                if limit is not None and sent + len(piece) > limit:
                    piece = piece[: limit - sent]
                    self.bytes_sent[path] = self.bytes_sent.get(path, 0) + len(piece)
                    yield piece
                    raise ConnectionResetError("the fake hub drops the connection")
                sent += len(piece)
                self.bytes_sent[path] = self.bytes_sent.get(path, 0) + len(piece)
                yield piece

        status = 206 if range_header else 200
        headers["Content-Length"] = str(len(body))
        if range_header:
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        return StreamingResponse(chunks(), status_code=status, headers=headers)  # type: ignore[arg-type]


def _error(status: int, code: str) -> Response:
    return JSONResponse({"error": code}, status_code=status, headers={"X-Error-Code": code})
