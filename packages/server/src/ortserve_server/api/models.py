"""``GET /v1/models`` and ``/v1/models/{id}``: the model cards."""

from __future__ import annotations

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery
from ortserve_client import protocol as p
from ortserve_runtime import (
    AdapterNotFoundError,
)

from .._errors import BadRequestError
from .._leases import model_adapters, split_adapter
from .._openapi import GET_ERRORS, error_responses
from .._state import OrtServe

__all__ = ["list_models", "model_card", "retrieve_model"]


@get("/models", summary="List models", responses=error_responses(400, *GET_ERRORS))
async def list_models(
    ortserve: NamedDependency[OrtServe],
    limit: FromQuery[int | None] = None,
    after_id: FromQuery[str | None] = None,
    before_id: FromQuery[str | None] = None,
) -> p.ModelList:
    """Every model; with Anthropic's ``limit`` (1 to 1,000, default 20), ``after_id`` or
    ``before_id`` (the Anthropic SDK's ``models.list``), a page of them in the same order."""
    cards = []
    for name in ortserve.registry.names():
        cards.append(model_card(ortserve, name))
        cards.extend(model_card(ortserve, name, adapter) for adapter in model_adapters(ortserve, name))
    if limit is None and after_id is None and before_id is None:
        return p.ModelList(data=cards)
    if limit is not None and not 1 <= limit <= _MAX_PAGE:
        raise BadRequestError(f"limit must be between 1 and {_MAX_PAGE}, not {limit}", param="limit")
    if after_id is not None and before_id is not None:
        raise BadRequestError("give after_id or before_id, not both", param="before_id")
    ids = [card.id for card in cards]
    size = limit or 20
    start, end = 0, len(cards)
    for cursor, name in ((after_id, "after_id"), (before_id, "before_id")):
        if cursor is not None and cursor not in ids:
            raise BadRequestError(f"{name} {cursor!r} is not a model's id", param=name)
    if after_id is not None:
        start = ids.index(after_id) + 1
    if before_id is not None:
        end = ids.index(before_id)
        start = max(end - size, 0)
    page = cards[start : min(end, start + size)]
    more = start > 0 if before_id is not None else start + size < end
    return p.ModelList(
        data=page, has_more=more, first_id=page[0].id if page else None, last_id=page[-1].id if page else None
    )


_MAX_PAGE = 1000


@get("/models/{model_id:path}", summary="Retrieve a model", responses=error_responses(404, *GET_ERRORS))
async def retrieve_model(model_id: FromPath[str], ortserve: NamedDependency[OrtServe]) -> p.Model:
    name, adapter = split_adapter(ortserve, model_id.lstrip("/"))
    if name not in ortserve.registry.names():
        from .._errors import ModelNotFoundHTTPError

        raise ModelNotFoundHTTPError(f"model {name!r} does not exist", param="model")
    if adapter is not None and adapter not in model_adapters(ortserve, name):
        raise AdapterNotFoundError(name, adapter, model_adapters(ortserve, name))
    return model_card(ortserve, name, adapter)


def model_card(state: OrtServe, name: str, adapter: str | None = None) -> p.Model:
    """The card of model ``name``, or of its LoRA ``adapter`` (id ``name:adapter``), with
    ortserve's status fields (an adapter's are its model's: it loads with it)."""
    status = state.registry.status_of(name)
    return p.Model(
        id=name if adapter is None else f"{name}:{adapter}",
        created=state.created,
        owned_by="ortserve",
        kind=status.kind,
        status=status.state,
        progress=status.progress,
        provider=status.provider,
        engine=status.engine,
        engine_reason=status.engine_reason,
        prefill_int8=status.prefill_int8,
        kv_cache_dtype=status.kv_cache_dtype,
        reproducible=status.reproducible,
        input_modalities=None if status.input_modalities is None else list(status.input_modalities),
        voices=None if status.voices is None else list(status.voices),
        tool_format=status.tool_format,
        tools_in_system_prompt=status.tools_in_system_prompt,
        reasoning=status.reasoning,
        speculative=status.speculative,
        draft_tokens=status.draft_tokens,
        draft_acceptance_rate=(
            status.accepted_draft_tokens / status.draft_tokens
            if status.draft_tokens and status.accepted_draft_tokens is not None
            else None
        ),
        parent=None if adapter is None else name,
        root=None if adapter is None else name,
        error=status.error,
        in_flight=status.in_flight,
        last_used=_unix(status.last_used),
        resident_bytes=status.resident_bytes,
        kv_cache_bytes=status.kv_cache_bytes,
        expires_at=_unix(status.expires_at),
    )


def _unix(moment: float | None) -> int | None:
    return None if moment is None else int(moment)
