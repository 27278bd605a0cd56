"""``POST /v1/embeddings``."""

from __future__ import annotations

import base64
from typing import Any, cast

from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p

from .._connection import while_connected
from .._errors import (
    BadRequestError,
)
from .._generation import SPLICE, encode_json, json_answer
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
    as_base64 = data.encoding_format == "base64"

    def answer() -> tuple[p.CreateEmbeddingResponse, list[list[bytes]]]:
        items = [
            encode_json(
                p.Embedding(
                    index=i,
                    embedding=base64.b64encode(vector.astype("<f4").tobytes()).decode()
                    if as_base64
                    else vector.tolist(),
                )
            )
            for i, vector in enumerate(result.vectors)
        ]
        spliced = cast("list[p.Embedding]", SPLICE)
        return p.CreateEmbeddingResponse(data=spliced, model=data.model, usage=usage), [items]

    return await json_answer(answer)
