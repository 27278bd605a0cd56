"""The web page's routes: the page and its files (``ServerConfig.ui_path``), and the
conversations it keeps on the server (``{path}/ui/conversations``).

The page is a client of the public API like any other (it calls ``/v1/models``,
``/v1/chat/completions``, ``/metrics``... with the key the user gives it); what only it
needs is the conversation store, a small route family under the API's prefix, its keys
and its guards. The page's files are read once and served from memory by name: no path
from a request reaches the file system.
"""

from __future__ import annotations

import hashlib
import html
import posixpath
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery, JSONBody
from litestar.response import Stream
from ortserve_client import conversations_protocol as cp

from .._auth import caller_of
from .._conversation_store import ConversationsFull, ConversationTooLarge, summary
from .._errors import BadRequestError, NotFoundError, PayloadTooLargeError
from .._json_bounds import DEEPER_BY
from .._openapi import GET_ERRORS, POST_ERRORS, error_responses, with_error_responses
from .._state import OrtServe

__all__ = ["CONTENT_SECURITY_POLICY", "conversation_route_handlers", "page_route_handlers"]

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; "
    "script-src 'self'; "  # the page's own modules: no inline script, no eval
    "style-src 'self'; "
    "img-src 'self' data: blob:; "  # images the user attaches, as data: URLs
    "media-src 'self' data: blob:; "  # speech the server reads aloud
    "connect-src 'self'; "  # the API of the server that served the page, nothing else
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own files and its own server only."""

_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Permissions-Policy": "microphone=(self), camera=(), geolocation=()",
    "Cache-Control": "no-cache",
}
_TYPES = {  # Litestar adds "; charset=utf-8" to text types
    ".html": "text/html",
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".txt": "text/plain",
}
MAX_LISTED = 1000
MAX_SEARCH = 200


def _read_files() -> dict[str, tuple[bytes, str, str]]:
    """The page's files by path under ``static/`` (``vendor/marked.esm.js``), with their
    media types and ETags."""
    found: dict[str, tuple[bytes, str, str]] = {}

    def walk(folder: Any, prefix: str) -> None:
        for entry in folder.iterdir():
            name = f"{prefix}{entry.name}"
            if entry.is_dir():
                walk(entry, f"{name}/")
            elif (kind := _TYPES.get(posixpath.splitext(entry.name)[1])) is not None:
                content = entry.read_bytes()
                found[name] = (content, kind, f'"{hashlib.sha256(content).hexdigest()[:32]}"')

    walk(resources.files(__package__).joinpath("static"), "")
    return found


_FILES = _read_files()
_INDEX = _FILES.pop("index.html")[0].decode()


@get("/", include_in_schema=False)
async def page(ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]) -> Response[bytes]:
    """The page, with the paths of its files and of the API it calls filled in (absolute,
    below the prefix a host mounted ortserve at)."""
    config = ortserve.config
    root = str(request.scope.get("root_path", "")).rstrip("/")
    paths = {
        "base": f"{root}{config.ui_path.rstrip('/')}/assets/",
        "api": f"{root}{config.path.rstrip('/')}",
        "metrics": f"{root}{config.metrics_path}" if config.metrics_path else "",
        # Which keys the page must ask for before its first call (a 401 says as much, and
        # a browser logs each 401 as an error): "api", "admin", both or none.
        "keys": " ".join(k for k, on in (("api", config.api_keys), ("admin", config.admin_key)) if on),
        # The configured MCP servers' labels (letters, digits, - and _): the page offers them.
        "mcp": " ".join(server.label for server in config.mcp_servers),
    }
    text = _INDEX
    for name, value in paths.items():
        text = text.replace(f"{{{{{name}}}}}", html.escape(value, quote=True))
    return Response(text.encode(), media_type=_TYPES[".html"], headers=_HEADERS)


@get("/assets/{name:path}", include_in_schema=False)
async def asset(name: FromPath[str], request: Request[Any, Any, Any]) -> Response[bytes]:
    found = _FILES.get(name.lstrip("/"))
    if found is None:
        raise NotFoundError(f"no file {name!r} in the web page", param="name")
    content, kind, etag = found
    headers = {**_HEADERS, "ETag": etag}
    if request.headers.get("if-none-match") == etag:  # "no-cache": the browser asks each time
        return Response(b"", status_code=304, headers=headers)
    return Response(content, media_type=kind, headers=headers)


page_route_handlers = [page, asset]
"""Served at ``ServerConfig.ui_path``, behind the Host/Origin checks only: the page asks
for the API key itself."""


# -- conversations ---------------------------------------------------------------------------


def _not_found(conversation_id: str) -> NotFoundError:
    return NotFoundError(f"no conversation {conversation_id!r}", param="conversation_id")


def _bounds_error(exc: Exception) -> PayloadTooLargeError:
    """413, as for files when the server's room for them is full."""
    return PayloadTooLargeError(str(exc))


@get(
    "/ui/conversations",
    summary="List the web page's conversations (extension)",
    responses=error_responses(400, *GET_ERRORS),
)
async def list_conversations(
    ortserve: NamedDependency[OrtServe],
    request: Request[Any, Any, Any],
    search: FromQuery[str | None] = None,
    limit: FromQuery[int] = 100,
) -> cp.ConversationList:
    """The caller's conversations, most recently updated first; ``search`` keeps those whose
    title or text holds it (case-insensitive)."""
    if not 1 <= limit <= MAX_LISTED:
        raise BadRequestError(f"'limit' must be between 1 and {MAX_LISTED}, not {limit}", param="limit")
    if search is not None and len(search) > MAX_SEARCH:
        raise BadRequestError(f"'search' may have at most {MAX_SEARCH} characters", param="search")
    found = await ortserve.conversations.summaries(caller_of(request).owner, limit + 1, search)
    return cp.ConversationList(data=found[:limit], has_more=len(found) > limit)


@post(
    "/ui/conversations",
    status_code=200,
    summary="Create a conversation (extension)",
    responses=error_responses(*POST_ERRORS),
)
async def create_conversation(
    data: JSONBody[cp.ConversationWrite], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> cp.Conversation:
    try:
        (made,) = await ortserve.conversations.create(caller_of(request).owner, data)
    except (ConversationsFull, ConversationTooLarge) as exc:
        raise _bounds_error(exc) from None
    return made


@get(
    "/ui/conversations/export",
    summary="Export every conversation (extension)",
    responses=with_error_responses(cp.ConversationExport, "Every conversation of the key, whole", *GET_ERRORS),
)
async def export_conversations(ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]) -> Stream:
    """A ``ConversationExport``, written a conversation at a time: a key's conversations
    together are up to 8 GiB, more than the server could hold at once."""
    conversations = ortserve.conversations.export(caller_of(request).owner)

    async def written() -> AsyncIterator[bytes]:
        yield b'{"data":['
        separator = b""
        async for conversation in conversations:
            yield separator + msgspec.json.encode(conversation)
            separator = b","
        yield b'],"object":"list"}'

    return Stream(written(), media_type="application/json")


@post(
    "/ui/conversations/import",
    status_code=200,
    summary="Import conversations (extension)",
    description="Takes an export's JSON; each conversation gets a new id, keeps its timestamps. All or none.",
    responses=error_responses(*POST_ERRORS),
    # An export holds each conversation two levels deeper than it was sent (twenty-fifth
    # probe, issue 45: one sent near the nesting bound could not be imported back).
    opt={DEEPER_BY: 2},
)
async def import_conversations(
    data: JSONBody[cp.ConversationImport], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> cp.ConversationList:
    try:
        made = await ortserve.conversations.create(caller_of(request).owner, *data.data)
    except (ConversationsFull, ConversationTooLarge) as exc:
        raise _bounds_error(exc) from None
    return cp.ConversationList(data=[summary(c) for c in made])


@get(
    "/ui/conversations/{conversation_id:str}",
    summary="Retrieve a conversation (extension)",
    responses=error_responses(404, *GET_ERRORS),
)
async def retrieve_conversation(
    conversation_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> cp.Conversation:
    found = await ortserve.conversations.get(caller_of(request).owner, conversation_id)
    if found is None:
        raise _not_found(conversation_id)
    return found


@post(
    "/ui/conversations/{conversation_id:str}",
    status_code=200,
    summary="Update a conversation (extension)",
    description="Replaces the fields the body gives (rename: `title` alone; the page sends `messages` after each reply).",
    responses=error_responses(*POST_ERRORS),
)
async def update_conversation(
    conversation_id: FromPath[str],
    data: JSONBody[cp.ConversationWrite],
    ortserve: NamedDependency[OrtServe],
    request: Request[Any, Any, Any],
) -> cp.Conversation:
    try:
        found = await ortserve.conversations.update(caller_of(request).owner, conversation_id, data)
    except (ConversationsFull, ConversationTooLarge) as exc:
        raise _bounds_error(exc) from None
    if found is None:
        raise _not_found(conversation_id)
    return found


@delete(
    "/ui/conversations/{conversation_id:str}",
    status_code=200,
    summary="Delete a conversation (extension)",
    responses=error_responses(404, *GET_ERRORS),
)
async def delete_conversation(
    conversation_id: FromPath[str], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> cp.ConversationDeleted:
    if not await ortserve.conversations.delete(caller_of(request).owner, conversation_id):
        raise _not_found(conversation_id)
    return cp.ConversationDeleted(id=conversation_id)


conversation_route_handlers = [
    list_conversations,
    create_conversation,
    export_conversations,
    import_conversations,
    retrieve_conversation,
    update_conversation,
    delete_conversation,
]
"""Under the API's prefix, behind its guards and keys."""
