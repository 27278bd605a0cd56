"""``POST /v1/rerank`` and ``/v1/score`` (and vLLM's ``/rerank``, ``/v2/rerank`` at the root)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p
from ortserve_runtime import (
    RerankModel,
    RerankResult,
)

from .._connection import while_connected
from .._errors import (
    BadRequestError,
)
from .._ids import new_id
from .._leases import require_rerank_model
from .._openapi import POST_ERRORS, error_responses
from .._plan import check_room
from .._record import note
from .._state import OrtServe

__all__ = ["rerank", "rerank_alias", "score"]


async def _rerank(
    data: p.RerankRequest, ortserve: OrtServe, request: Request[Any, Any, Any]
) -> Response[p.RerankResponse]:
    model = await require_rerank_model(ortserve, data.model, data.keep_alive)
    documents = [d if isinstance(d, str) else d.text for d in data.documents]
    top_n = data.top_n if isinstance(data.top_n, int) else 0
    if top_n < 0:
        raise BadRequestError("top_n must be 0 or more (0 or absent: every document)", param="top_n")
    result = await _score_pairs(ortserve, request, model, data, data.query, documents, ("query", "documents"), "rerank")
    # Best first; equal scores keep the documents' order (sorted is stable).
    order = sorted(range(len(documents)), key=lambda i: -float(result.scores[i]))
    keep_documents = data.return_documents is not False
    results = [
        p.RerankResult(
            index=i,
            relevance_score=float(result.scores[i]),
            document=p.RerankDocument(text=documents[i]) if keep_documents else msgspec.UNSET,
        )
        for i in order[: top_n or None]
    ]
    tokens = result.prompt_tokens
    usage = p.RerankUsage(prompt_tokens=tokens, total_tokens=tokens)
    return Response(p.RerankResponse(id=new_id("rerank-"), model=data.model, usage=usage, results=results))


async def _score_pairs(
    ortserve: OrtServe,
    request: Request[Any, Any, Any],
    model: RerankModel,
    data: p.RerankRequest | p.ScoreRequest,
    first: str | list[str],
    second: list[str],
    names: tuple[str, str],
    route: str,
) -> RerankResult:
    """Score ``first`` against each of ``second`` (``names``: their request fields) for
    ``/rerank`` or ``/score``: the size limit, queue room, truncation and the metrics both share."""
    if len(second) > model.max_documents:
        raise BadRequestError(
            f"{names[1]} has {len(second)} items; this server scores at most {model.max_documents} per request",
            param=names[1],
        )
    check_room(ortserve, model, model.batches(len(second)), names[1], "batches")
    truncate = data.truncate if isinstance(data.truncate, bool) else None
    result = await while_connected(request, ortserve, model.score(first, second, truncate=truncate, names=names))
    ortserve.metrics.count_request(f"{ortserve.config.path}/{route}", data.model, 200)
    ortserve.metrics.prompt_tokens.labels(data.model).inc(result.prompt_tokens)
    note(model=data.model, input_tokens=result.prompt_tokens)
    return result


@post(
    "/rerank",
    status_code=200,
    summary="Rerank documents by relevance to a query (cross-encoder models; Jina/Cohere shape, as vLLM)",
    responses=error_responses(*POST_ERRORS),
)
async def rerank(
    data: JSONBody[p.RerankRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[p.RerankResponse]:
    return await _rerank(data, ortserve, request)


@post(["/rerank", "/v2/rerank"], status_code=200, include_in_schema=False)
async def rerank_alias(
    data: JSONBody[p.RerankRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[p.RerankResponse]:
    """vLLM's aliases of ``/v1/rerank`` (llama-server also answers ``/rerank``), at the root."""
    return await _rerank(data, ortserve, request)


@post(
    "/score",
    status_code=200,
    summary="Score text pairs (cross-encoder models; vLLM's shape): 1:1, 1:N or N:N",
    responses=error_responses(*POST_ERRORS),
)
async def score(
    data: JSONBody[p.ScoreRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[p.ScoreResponse]:
    model = await require_rerank_model(ortserve, data.model, data.keep_alive)
    # vLLM's pairing: one text_1 (a string, or a list of one) with each text_2, else pairwise.
    first = data.text_1[0] if isinstance(data.text_1, list) and len(data.text_1) == 1 else data.text_1
    second = [data.text_2] if isinstance(data.text_2, str) else data.text_2
    result = await _score_pairs(ortserve, request, model, data, first, second, ("text_1", "text_2"), "score")
    tokens = result.prompt_tokens
    return Response(
        p.ScoreResponse(
            id=new_id("score-"),
            created=int(time.time()),
            model=data.model,
            data=[p.ScoreData(index=i, score=float(value)) for i, value in enumerate(result.scores)],
            usage=p.RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
    )
