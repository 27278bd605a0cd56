"""``POST /v1/completions``."""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p
from ortserve_runtime import (
    TokenLogprob,
    ToolCall,
)

from .._connection import while_connected
from .._generation import Generation, include_usage, sse_event, stream_response
from .._ids import new_id
from .._leases import require_model
from .._openapi import generation_docs
from .._plan import start_completion
from .._state import OrtServe

__all__ = ["completions"]


@post(
    "/completions",
    status_code=200,
    summary="Create a (legacy) text completion",
    **generation_docs(p.Completion, "The completion"),
)
async def completions(
    data: JSONBody[p.CompletionRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[Any]:
    model = await require_model(ortserve, data.model, data.keep_alive)
    run = Generation(
        ortserve, f"{ortserve.config.path}/completions", await start_completion(ortserve, model, data, request)
    )
    response_id, created = new_id("cmpl-"), int(time.time())

    def chunk(choices: list[p.CompletionChoice], usage: p.CompletionUsage | None = None) -> bytes:
        return sse_event(p.Completion(id=response_id, created=created, model=data.model, choices=choices, usage=usage))

    def events(index: int, text: str, _: list[ToolCall], reason: str | None) -> list[bytes]:
        scored = run.event_logprobs
        if not text and reason is None and scored is None:
            return []
        logprobs = _completion_logprobs([scored]) if scored is not None else None
        return [chunk([p.CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=logprobs)])]

    if data.stream is True:
        usage_chunk = (lambda usage: chunk([], usage)) if include_usage(data.stream_options) else None
        return stream_response(run.sse(events, usage_chunk))
    texts, _, finish, usage = await while_connected(request, ortserve, run.collect())
    wanted = isinstance(data.logprobs, int)
    choices = [
        p.CompletionChoice(
            index=i, text=t, finish_reason=f, logprobs=_completion_logprobs(run.logprobs[i]) if wanted else None
        )
        for i, (t, f) in enumerate(zip(texts, finish, strict=True))
    ]
    return Response(p.Completion(id=response_id, created=created, model=data.model, choices=choices, usage=usage))


def _completion_logprobs(items: list[TokenLogprob]) -> p.CompletionLogprobs:
    """The legacy shape; as OpenAI documents, the chosen token is always among a step's
    ``top_logprobs`` (so it may hold one more than asked for)."""
    top: list[dict[str, float] | None] = []
    for item in items:
        best = {t.text: t.logprob for t in item.top}
        best.setdefault(item.text, item.logprob)
        top.append(best)
    return p.CompletionLogprobs(
        tokens=[item.text for item in items],
        token_logprobs=[item.logprob for item in items],
        top_logprobs=top,
        text_offset=[item.offset for item in items],
    )
