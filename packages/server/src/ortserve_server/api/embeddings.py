"""``POST /v1/embeddings``."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterable
from typing import Any, cast

import msgspec
from litestar import MediaType, Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p

from .._connection import while_connected
from .._errors import (
    BadRequestError,
)
from .._leases import require_embedding_model
from .._openapi import POST_ERRORS, error_responses
from .._plan import check_room
from .._record import note
from .._state import OrtServe

__all__ = ["embeddings"]


@post("/embeddings", status_code=200, summary="Create embeddings", responses=error_responses(*POST_ERRORS))
async def embeddings(
    data: JSONBody[p.EmbeddingRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[p.CreateEmbeddingResponse]:
    model = await require_embedding_model(ortserve, data.model, data.keep_alive)
    given = data.input
    # Text, or token ids: one input; a list of texts or of token-id lists: one each.
    inputs = len(given) if isinstance(given, list) and given and not isinstance(given[0], int) else 1
    if inputs > model.max_inputs:
        raise BadRequestError(
            f"input has {inputs} items; this server embeds at most {model.max_inputs} per request", param="input"
        )
    check_room(ortserve, model, model.batches(inputs), "input", "batches")
    truncate = data.truncate if isinstance(data.truncate, bool) else None
    dimensions = data.dimensions if isinstance(data.dimensions, int) else None
    # A client that gives up stops its runs (a 2,048-input request ran 198 s on alone).
    result = await while_connected(request, ortserve, model.embed(data.input, truncate=truncate, dimensions=dimensions))
    ortserve.metrics.count_request(f"{ortserve.config.path}/embeddings", data.model, 200)
    ortserve.metrics.prompt_tokens.labels(data.model).inc(result.prompt_tokens)
    note(model=data.model, input_tokens=result.prompt_tokens)
    usage = p.EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    envelope = p.CreateEmbeddingResponse(data=[], model=data.model, usage=usage)
    body = await asyncio.to_thread(_encoded, envelope, result.vectors, data.encoding_format == "base64")
    # Bytes are sent as they are; the annotation keeps the answer's schema in the OpenAPI document.
    return Response(cast("p.CreateEmbeddingResponse", body), media_type=MediaType.JSON)


def _encoded(envelope: p.CreateEmbeddingResponse, vectors: Iterable[Any], as_base64: bool) -> bytes:
    """The answer's JSON, made a vector at a time on a worker thread: 2,048 vectors as floats
    are 16.6 MB of JSON, and encoded whole (on the event loop, or in one call that holds the
    GIL) they held every other request 130-180 ms."""
    items = [
        _encode_item(
            p.Embedding(
                index=i,
                embedding=base64.b64encode(vector.astype("<f4").tobytes()).decode() if as_base64 else vector.tolist(),
            )
        )
        for i, vector in enumerate(vectors)
    ]
    # The envelope's "data":[] is its only such bytes (a quote inside a JSON string is escaped).
    return msgspec.json.encode(envelope).replace(b'"data":[]', b'"data":[' + b",".join(items) + b"]", 1)


_encode_item = msgspec.json.Encoder().encode
