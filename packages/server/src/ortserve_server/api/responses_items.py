"""The items of stored responses: the ids they are kept with, and
``GET /v1/responses/{id}/input_items``, which lists a stored response's input a page at a
time as OpenAI lists it."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from litestar import Request, get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from ortserve_client import responses_protocol as rp

from .._auth import caller_of
from .._errors import BadRequestError, NotFoundError
from .._ids import new_id
from .._openapi import GET_ERRORS, error_responses
from .._state import OrtServe

__all__ = ["ResponseNotFoundError", "list_input_items", "with_id"]


class ResponseNotFoundError(NotFoundError):
    code = "response_not_found"


_ITEM_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}
_MAX_LISTED_ITEMS = 100


def with_id(item: rp.InputItem, fallback: str | None = None) -> rp.InputItem:
    """``item`` with an id of its own, as OpenAI gives every item it keeps (``input_items``
    pages by them; a follow-up's items from earlier turns keep theirs): ``fallback``, or a
    new one."""
    if isinstance(item.id, str):
        return item
    tag = type(item).__struct_config__.tag
    return msgspec.structs.replace(item, id=fallback or new_id(_ITEM_ID_PREFIXES.get(str(tag), "mcpr_")))


def _as_listed(item: rp.InputItem) -> rp.InputItem:
    """A message's text as the content part OpenAI lists it in (``input_text``, or
    ``output_text`` for the assistant's), where the request gave a bare string."""
    if isinstance(item, rp.InputMessage) and isinstance(item.content, str):
        part = rp.OutputText(text=item.content) if item.role == "assistant" else rp.InputText(text=item.content)
        return msgspec.structs.replace(item, content=[part])
    return item


@get(
    "/responses/{response_id:str}/input_items",
    summary="List a stored response's input items",
    responses=error_responses(400, 404, *GET_ERRORS),
)
async def list_input_items(
    response_id: FromPath[str],
    ortserve: NamedDependency[OrtServe],
    request: Request[Any, Any, Any],
    limit: FromQuery[int] = 20,
    order: FromQuery[Literal["asc", "desc"]] = "desc",
    after: FromQuery[str | None] = None,
    before: FromQuery[str | None] = None,
) -> rp.InputItemList:
    """The items the response took as input: the conversation it continued (through
    ``previous_response_id``) and then its own ``input``, as OpenAI lists them (newest first
    unless ``order=asc``; ``after``/``before`` an item id of the list)."""
    if not 1 <= limit <= _MAX_LISTED_ITEMS:  # OpenAI's range
        raise BadRequestError(f"'limit' must be between 1 and {_MAX_LISTED_ITEMS}, not {limit}", param="limit")
    stored = await ortserve.responses.get(caller_of(request).owner, response_id)
    if stored is None:
        raise ResponseNotFoundError(f"response {response_id!r} was not found", param="response_id")
    inputs = stored.items[: len(stored.items) - len(stored.response.output)]
    # Responses stored before items had ids: ids from their place, the same at every call.
    items = [_as_listed(with_id(item, f"item_{response_id}_{n}")) for n, item in enumerate(inputs)]
    if order == "desc":
        items.reverse()
    ids = [str(item.id) for item in items]
    for cursor, param in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise BadRequestError(f"{param}: no item {cursor!r} in this response's input", param=param)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    if before is not None and after is None:  # the page just before the cursor
        first, last = max(start, end - limit), end
        has_more = first > start
    else:
        first, last = start, min(end, start + limit)
        has_more = last < end
    return rp.InputItemList(
        data=items[first:last],
        has_more=has_more,
        first_id=ids[first] if first < last else None,
        last_id=ids[last - 1] if first < last else None,
    )
