"""The Batch API's routes: ``/v1/files`` and ``/v1/batches`` (the runner that works
through a batch's lines is ``_batch_runner``)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from litestar import Request, delete, get, post
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody, MultipartBody
from litestar.response import Stream
from ortserve_client import batch_protocol as bp
from ortserve_client import protocol as p
from ortserve_client import responses_protocol as rp

from .._auth import caller_of
from .._batch_store import NoRoomError
from .._errors import BadRequestError, NotFoundError, PayloadTooLargeError
from .._ids import new_id
from .._json_bounds import MAX_JSON_DEPTH, counts_past_bounds, json_depth
from .._openapi import GET_ERRORS, POST_ERRORS, error_responses
from .._record import traceparent
from .._security import check_known_fields
from .._settings_fields import check_settings_fields
from .._state import OrtServe
from .responses import check_metadata

__all__ = ["batch_route_handlers"]

MAX_LINES = 50_000
"""Lines a batch's input file may have (OpenAI's bound)."""
COMPLETION_WINDOW = 24 * 3600.0
_BODY_TYPES: dict[str, type[Any]] = {
    "/v1/chat/completions": p.ChatCompletionRequest,
    "/v1/completions": p.CompletionRequest,
    "/v1/embeddings": p.EmbeddingRequest,
    "/v1/responses": rp.ResponseCreateRequest,
}


_decode_line = msgspec.json.Decoder(bp.BatchInputLine).decode


class _KnownKeysLine(bp.BatchInputLine, forbid_unknown_fields=True):
    """A line whose own keys are only those of :class:`~ortserve_client.batch_protocol.BatchInputLine`
    (twenty-first probe, issue 45: others were taken and ignored)."""


_decode_known_line = msgspec.json.Decoder(_KnownKeysLine).decode
_MAX_LISTED_FILES = 10_000
_MAX_LISTED_BATCHES = 100


# -- files -----------------------------------------------------------------------------------


@dataclass
class FileForm:
    """The multipart form of ``POST /v1/files``."""

    purpose: str
    file: UploadFile | None = None


def _lines(content: bytes) -> Iterator[bytes]:
    """The lines of ``content`` (ended by ``\n`` or ``\r\n``), copied one at a time: on a
    worker thread, ``splitlines`` copied a 90 MB file in one call, holding the GIL, so the
    event loop, 170-340 ms."""
    start = 0
    while start < len(content):
        end = content.find(b"\n", start)
        end = len(content) if end < 0 else end
        yield content[start:end].removesuffix(b"\r")
        start = end + 1


def _check_line_bounds(raw: bytes, where: str, max_line: int) -> None:
    """A request body's bounds, for a line before it is decoded: its size, nesting, keys and items."""
    if len(raw) > max_line:
        raise BadRequestError(
            f"{where} has {len(raw)} bytes; a request has at most {max_line} (max_body_size)", param="file"
        )
    if (depth := json_depth(raw) - 1) > MAX_JSON_DEPTH:  # the body, within the line's object
        raise BadRequestError(
            f"{where}: the JSON is nested too deeply ({depth} levels; at most {MAX_JSON_DEPTH})", param="file"
        )
    if (past := counts_past_bounds(raw)) is not None:
        what, field = past
        raise BadRequestError(
            f"{where}: the JSON has {what}" + (f", most of them in {field!r}" if field else ""), param="file"
        )


def check_batch_file(content: bytes, max_line: int, *, lenient: bool) -> list[tuple[str, bytes, str]]:
    """The lines of a batch input file as (custom id, body, url); a 400 naming the first
    line that is not a request a batch can run: a body with a field its route does not
    take is one unless ``lenient``, as for a request sent alone. A line longer than ``max_line`` (the server's
    ``max_body_size``) is refused here: run, it was answered 413 only after the runner had
    decoded it on the event loop (a 90 MiB line held /health 521 ms, +371 MiB)."""
    lines: list[tuple[str, bytes, str]] = []
    seen: set[str] = set()
    for number, raw in enumerate(_lines(content), 1):
        if not raw.strip():
            continue
        where = f"line {number}"
        _check_line_bounds(raw, where, max_line)
        try:
            line = (_decode_line if lenient else _decode_known_line)(raw)
        except msgspec.DecodeError as exc:
            unknown = "unknown field" in str(exc) and " (start it with --lenient to ignore fields it does not know)"
            raise BadRequestError(f"{where}: {exc}{unknown or ''}", param="file") from exc
        except RecursionError:
            raise BadRequestError(f"{where}: the JSON is nested too deeply", param="file") from None
        body_type = _BODY_TYPES.get(line.url)
        if body_type is None:
            raise BadRequestError(
                f"{where}: url {line.url!r} is not one a batch runs: {', '.join(bp.BATCH_ENDPOINTS)}", param="file"
            )
        if line.custom_id in seen:
            raise BadRequestError(f"{where}: custom_id {line.custom_id!r} is used twice", param="file")
        if line.body.get("stream"):
            raise BadRequestError(f"{where}: body.stream: the lines of a batch do not stream", param="file")
        try:
            msgspec.convert(line.body, body_type)
        except msgspec.ValidationError as exc:
            raise BadRequestError(f"{where}: body: {exc}", param="file") from exc
        except RecursionError:
            raise BadRequestError(f"{where}: body: the JSON is nested too deeply", param="file") from None
        if not lenient:
            check_known_fields(line.body, body_type, where=f"{where}: body: ", param="file")
            check_settings_fields(line.body, body_type, where=f"{where}: body: ", param="file")
        seen.add(line.custom_id)
        lines.append((line.custom_id, msgspec.json.encode(line.body), line.url))
        if len(lines) > MAX_LINES:
            raise BadRequestError(f"a batch file has at most {MAX_LINES} lines", param="file")
    if not lines:
        raise BadRequestError("the file has no lines: a batch file has one JSON request per line", param="file")
    return lines


@post(
    "/files",
    status_code=200,
    summary="Upload a file (purpose batch: JSONL)",
    responses=error_responses(*POST_ERRORS, 507),
)
async def create_file(
    data: MultipartBody[FileForm], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> bp.FileObject:
    if data.purpose != "batch":
        raise BadRequestError(f"purpose {data.purpose!r}: this server keeps files for batches only", param="purpose")
    if data.file is None:
        raise BadRequestError("'file' is required: the JSONL file, as a multipart file", param="file")
    unknown = sorted(set(await request.form()) - {"purpose", "file"})
    if unknown:  # OpenAI's expires_after[...] among them: refused rather than ignored (sixteenth probe)
        name = unknown[0].split("[")[0]
        raise BadRequestError(f"'{unknown[0][:80]}' is not supported by this server", param=name[:80])
    content = await data.file.read()
    if len(content) > ortserve.config.max_file_size:
        raise PayloadTooLargeError(f"a file may have at most {ortserve.config.max_file_size} bytes")
    await asyncio.to_thread(
        functools.partial(check_batch_file, content, ortserve.config.max_body_size, lenient=ortserve.config.lenient)
    )  # 90 MB of lines held the event loop 882 ms
    try:
        return await ortserve.batches.add_file(caller_of(request).owner, "batch", data.file.filename or "", content)
    except NoRoomError as exc:
        raise PayloadTooLargeError(str(exc)) from None


_OPENAI_PURPOSES = frozenset(
    {
        "assistants",
        "assistants_output",
        "batch",
        "batch_output",
        "evals",
        "fine-tune",
        "fine-tune-results",
        "user_data",
        "vision",
    }
)
"""The purposes OpenAI's files have: a list of any other is a 400 (of these, this server keeps
``batch`` and ``batch_output`` files; the others list none)."""


def _unknown_cursor(kind: str, after: str | None) -> BadRequestError:
    return BadRequestError(f"'after' is {after!r}, which is none of this API key's {kind} ids", param="after")


@get("/files", summary="List files", responses=error_responses(400, *GET_ERRORS))
async def list_files(
    ortserve: NamedDependency[OrtServe],
    request: Request[Any, Any, Any],
    purpose: FromQuery[str | None] = None,
    limit: FromQuery[int] = _MAX_LISTED_FILES,
    after: FromQuery[str | None] = None,
    order: FromQuery[Literal["asc", "desc"]] = "desc",
) -> bp.FileList:
    if not 1 <= limit <= _MAX_LISTED_FILES:  # OpenAI's range
        raise BadRequestError(f"'limit' must be between 1 and {_MAX_LISTED_FILES}, not {limit}", param="limit")
    if purpose is not None and purpose not in _OPENAI_PURPOSES:  # twenty-third probe: listed nothing, 200
        raise BadRequestError(
            f"purpose {purpose!r} is none of OpenAI's: {', '.join(sorted(_OPENAI_PURPOSES))}", param="purpose"
        )
    found = await ortserve.batches.files(
        caller_of(request).owner, purpose, limit + 1, after, newest_first=order == "desc"
    )
    if found is None:
        raise _unknown_cursor("file", after)
    return bp.FileList(
        data=found[:limit],
        has_more=len(found) > limit,
        first_id=found[0].id if found else None,
        last_id=found[:limit][-1].id if found else None,
    )


@get("/files/{file_id:str}", summary="Retrieve a file", responses=error_responses(404, *GET_ERRORS))
async def retrieve_file(
    file_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> bp.FileObject:
    found = await ortserve.batches.file(caller_of(request).owner, file_id)
    if found is None:
        raise _no_file(file_id)
    return found


@get("/files/{file_id:str}/content", summary="A file's content", responses=error_responses(404, *GET_ERRORS))
async def file_content(
    file_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Stream:
    opened = await ortserve.batches.open_file(caller_of(request).owner, file_id)
    if opened is None:
        raise _no_file(file_id)
    found, pieces = opened
    return Stream(pieces, media_type="application/jsonl", headers={"Content-Length": str(found.bytes)})


@delete("/files/{file_id:str}", status_code=200, summary="Delete a file", responses=error_responses(404, *GET_ERRORS))
async def delete_file(
    file_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> bp.FileDeleted:
    if not await ortserve.batches.delete_file(caller_of(request).owner, file_id):
        raise _no_file(file_id)
    return bp.FileDeleted(id=file_id)


def _no_file(file_id: str) -> NotFoundError:
    return NotFoundError(f"no file {file_id!r}", param="file_id")


# -- batches ---------------------------------------------------------------------------------


@post("/batches", status_code=200, summary="Create a batch", responses=error_responses(404, *POST_ERRORS))
async def create_batch(
    data: JSONBody[bp.BatchCreateRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> bp.Batch:
    caller = caller_of(request)
    if data.endpoint not in _BODY_TYPES:
        raise BadRequestError(f"endpoint must be one of {', '.join(bp.BATCH_ENDPOINTS)}", param="endpoint")
    check_metadata(data.metadata)  # 20,000 pairs were kept with the batch
    async with ortserve.batches.intake:  # one file's lines held at a time
        content = await ortserve.batches.file_content(caller.owner, data.input_file_id)
        if content is None:
            raise NotFoundError(f"no file {data.input_file_id!r}", param="input_file_id")
        lines = await asyncio.to_thread(
            functools.partial(check_batch_file, content, ortserve.config.max_body_size, lenient=ortserve.config.lenient)
        )
        for number, (_, _, url) in enumerate(lines, 1):
            if url != data.endpoint:
                raise BadRequestError(
                    f"request {number} of the file has url {url!r}, the batch's endpoint is {data.endpoint!r}",
                    param="input_file_id",
                )
        now = int(time.time())
        batch = bp.Batch(
            id=new_id("batch_"),
            endpoint=data.endpoint,
            input_file_id=data.input_file_id,
            completion_window=data.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + int(COMPLETION_WINDOW),
            request_counts=bp.BatchRequestCounts(total=len(lines)),
            metadata=data.metadata,
        )
        try:
            await ortserve.batches.create_batch(
                caller.owner, caller.cache_scope, batch, [(c, b) for c, b, _ in lines], traceparent()
            )
        except NoRoomError as exc:
            raise PayloadTooLargeError(str(exc)) from None
    ortserve.batch_runner.start()
    return batch


@get("/batches", summary="List batches", responses=error_responses(400, *GET_ERRORS))
async def list_batches(
    ortserve: NamedDependency[OrtServe],
    request: Request[Any, Any, Any],
    limit: FromQuery[int] = 20,
    after: FromQuery[str | None] = None,
) -> bp.BatchList:
    ortserve.batch_runner.start()
    if not 1 <= limit <= _MAX_LISTED_BATCHES:  # OpenAI's range; was clamped, so -1 or 0 listed one
        raise BadRequestError(f"'limit' must be between 1 and {_MAX_LISTED_BATCHES}, not {limit}", param="limit")
    found = await ortserve.batches.batches(caller_of(request).owner, limit + 1, after)
    if found is None:
        raise _unknown_cursor("batch", after)
    shown = found[:limit]
    return bp.BatchList(
        data=shown,
        has_more=len(found) > limit,
        first_id=shown[0].id if shown else None,
        last_id=shown[-1].id if shown else None,
    )


@get("/batches/{batch_id:str}", summary="Retrieve a batch", responses=error_responses(404, *GET_ERRORS))
async def retrieve_batch(
    batch_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> bp.Batch:
    ortserve.batch_runner.start()  # resumes open batches where no lifespan ran
    found = await ortserve.batches.batch(caller_of(request).owner, batch_id)
    if found is None:
        raise NotFoundError(f"no batch {batch_id!r}", param="batch_id")
    return found


@post(
    "/batches/{batch_id:str}/cancel",
    status_code=200,
    summary="Cancel a batch",
    description="Lines running stop; the answers so far go to the output and error files.",
    responses=error_responses(404, *POST_ERRORS),
)
async def cancel_batch(
    batch_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> bp.Batch:
    found = await ortserve.batches.batch(caller_of(request).owner, batch_id)
    if found is None:
        raise NotFoundError(f"no batch {batch_id!r}", param="batch_id")
    if found.status in ("validating", "in_progress"):
        found.status, found.cancelling_at = "cancelling", int(time.time())
        if await ortserve.batches.update_batch(found, unless=("finalizing", "completed", "cancelled", "expired")):
            ortserve.batch_runner.cancel(batch_id)
        else:
            found = await ortserve.batches.batch(None, batch_id) or found
    elif found.status not in ("cancelling", "cancelled"):
        raise BadRequestError(f"batch {batch_id!r} is {found.status}: it cannot be cancelled", param="batch_id")
    ortserve.batch_runner.start()
    return found


batch_route_handlers = [
    create_file,
    list_files,
    retrieve_file,
    file_content,
    delete_file,
    create_batch,
    list_batches,
    retrieve_batch,
    cancel_batch,
]
