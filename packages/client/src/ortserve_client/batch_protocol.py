"""OpenAI's Files and Batch APIs (``/v1/files``, ``/v1/batches``) as msgspec Structs,
shared by client and server; the conventions of :mod:`ortserve_client.protocol`.

A batch's input is a JSONL file uploaded with purpose ``batch``: one :class:`BatchInputLine`
per line. Its results are two JSONL files of :class:`BatchOutputLine`: the output file
(answers with a 2xx status) and the error file (the others, and lines never run).
"""

from __future__ import annotations

from typing import Any, Literal

from .protocol import _Request, _Response  # the same conventions as the chat protocol

__all__ = [
    "BATCH_ENDPOINTS",
    "Batch",
    "BatchCreateRequest",
    "BatchError",
    "BatchErrors",
    "BatchInputLine",
    "BatchList",
    "BatchOutputLine",
    "BatchRequestCounts",
    "BatchResponse",
    "BatchStatus",
    "FileDeleted",
    "FileList",
    "FileObject",
    "LineError",
]

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""The endpoints a batch may run (its ``endpoint``, and each line's ``url``)."""

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


class FileObject(_Response):
    """An uploaded file (``POST /v1/files``), or a batch's output or error file."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    """``batch`` (uploaded input), ``batch_output`` (a batch's results)."""
    object: Literal["file"] = "file"
    status: str = "processed"
    expires_at: int | None = None


class FileList(_Response):
    data: list[FileObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class FileDeleted(_Response):
    id: str
    deleted: bool = True
    object: Literal["file"] = "file"


class BatchInputLine(_Request):
    """One line of a batch's input file."""

    custom_id: str
    """The caller's name for the line (unique in the file); its result carries it."""
    method: Literal["POST"]
    url: str
    """One of :data:`BATCH_ENDPOINTS`, the batch's own."""
    body: dict[str, Any]
    """The request body, as the endpoint takes it (``stream`` is not allowed)."""


class BatchCreateRequest(_Request):
    """``POST /v1/batches``."""

    input_file_id: str
    endpoint: str
    completion_window: Literal["24h"] = "24h"
    metadata: dict[str, str] | None = None


class BatchError(_Response):
    """Why a batch failed (its ``errors``)."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(_Response):
    data: list[BatchError]
    object: Literal["list"] = "list"


class BatchRequestCounts(_Response):
    total: int = 0
    completed: int = 0
    failed: int = 0


class Batch(_Response):
    """A batch (``POST``/``GET /v1/batches``); timestamps are Unix seconds."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    request_counts: BatchRequestCounts
    object: Literal["batch"] = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    metadata: dict[str, str] | None = None


class BatchList(_Response):
    data: list[Batch]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None
    object: Literal["list"] = "list"


class BatchResponse(_Response):
    """What the endpoint answered to a line."""

    status_code: int
    request_id: str
    body: Any
    """The endpoint's JSON answer (its error body for a 4xx or 5xx)."""


class LineError(_Response):
    """Why a line has no answer (it never ran: ``batch_expired``, ``batch_cancelled``)."""

    code: str
    message: str


class BatchOutputLine(_Response):
    """One line of a batch's output or error file."""

    id: str
    custom_id: str
    response: BatchResponse | None
    error: LineError | None
