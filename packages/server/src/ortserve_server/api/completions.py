"""``POST /v1/completions``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p
from ortserve_runtime import (
    ChatModel,
    PromptLogprobs,
    TokenLogprob,
    ToolCall,
)

from .._connection import while_connected
from .._generation import SPLICE, Generation, encode_json, include_usage, json_answer, sse_event, stream_response
from .._ids import new_id
from .._leases import require_model
from .._openapi import generation_docs
from .._plan import completion_prompts, start_completion
from .._record import note
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
    note(response_id=response_id)
    wanted = isinstance(data.logprobs, int)
    n = run.choices_per_prompt
    # echo: each choice's text (and logprobs) starts with its prompt's.
    echoed = _prompt_texts(model, data) if data.echo is True else None

    def chunk(choices: list[p.CompletionChoice], usage: p.CompletionUsage | None = None) -> bytes:
        return sse_event(p.Completion(id=response_id, created=created, model=data.model, choices=choices, usage=usage))

    started = [False] * len(run.streams)

    def events(index: int, text: str, _: list[ToolCall], reason: str | None) -> list[bytes]:
        scored = run.event_logprobs
        out = []
        shift = 0
        if echoed is not None:
            prompt = echoed[index // n]
            shift = len(prompt)
            if not started[index]:  # the prompt first, in a chunk of its own (as vLLM sends it)
                started[index] = True
                scores = run.event_prompt_logprobs
                logprobs = _raw_logprobs(_prompt_rows(scores)) if wanted and scores is not None else None
                out.append(chunk([p.CompletionChoice(index=index, text=prompt, logprobs=logprobs)]))
            if run.prompt_only:
                text, scored, reason = "", None, "length" if reason is not None else None
        if not text and reason is None and scored is None:
            return out
        logprobs = _raw_logprobs([_logprob_columns(scored, scored.offset + shift)]) if scored is not None else None
        out.append(chunk([p.CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=logprobs)]))
        return out

    if data.stream is True:
        usage_chunk = (lambda usage: chunk([], usage)) if include_usage(data.stream_options) else None
        return stream_response(run.sse(events, usage_chunk))

    def encode(index: int, item: TokenLogprob) -> Row:
        return _logprob_columns(item, item.offset + (len(echoed[index // n]) if echoed is not None else 0))

    collecting = run.collect(encode_logprobs=encode if wanted else None)
    texts, _, finish, usage = await while_connected(request, ortserve, collecting)
    choices = []
    for i, (text, reason) in enumerate(zip(texts, finish, strict=True)):
        prompt = echoed[i // n] if echoed is not None else ""
        if run.prompt_only:
            text, reason = "", "length"
        logprobs = _SPLICED if wanted else None
        choices.append(p.CompletionChoice(index=i, text=prompt + text, finish_reason=reason, logprobs=logprobs))
    answer = p.Completion(id=response_id, created=created, model=data.model, choices=choices, usage=usage)
    if not wanted:
        return Response(answer)

    def columns() -> tuple[p.Completion, list[Sequence[bytes]]]:
        """Each choice's four lists, its prompt's tokens first (echo)."""
        arrays: list[Sequence[bytes]] = []
        for i in range(len(choices)):
            arrays += _transposed([*_prompt_rows(run.prompt_logprobs[i]), *run.encoded_logprobs[i]])
        return answer, arrays

    return await json_answer(columns)


# An answer's logprobs are four lists per choice, spliced in (see json_answer).
_SPLICED = p.CompletionLogprobs(
    tokens=cast("list[str]", SPLICE),
    token_logprobs=cast("list[float | None]", SPLICE),
    top_logprobs=cast("list[dict[str, float] | None]", SPLICE),
    text_offset=cast("list[int]", SPLICE),
)


Row = tuple[bytes, bytes, bytes, bytes]
"""One token's entries in the legacy shape's four lists, as JSON."""


def _logprob_columns(item: TokenLogprob, offset: int) -> Row:
    """``item``'s row; ``offset``: characters of text (echoed prompt included) before it."""
    return encode_json(item.text), encode_json(item.logprob), encode_json(_best(item)), b"%d" % offset


def _best(item: TokenLogprob) -> dict[str, float]:
    """A step's ``top_logprobs``: as OpenAI documents, the chosen token is always among them
    (so it may hold one more than asked for)."""
    best = {t.text: t.logprob for t in item.top}
    best.setdefault(item.text, item.logprob)
    return best


def _prompt_rows(prompt: PromptLogprobs | None) -> list[Row]:
    """An echoed prompt's rows (none without its scores): its first token unscored (``null``,
    as OpenAI and vLLM)."""
    if prompt is None:
        return []
    first = (encode_json(prompt.first_text), b"null", b"null", b"0")  # nothing before it to score it
    return [first, *(_logprob_columns(item, item.offset) for item in prompt.scored)]


def _transposed(rows: list[Row]) -> list[Sequence[bytes]]:
    """The four lists of ``rows``."""
    return list(zip(*rows, strict=True)) if rows else [(), (), (), ()]


def _raw_logprobs(rows: list[Row]) -> p.CompletionLogprobs:
    """The legacy shape of a streamed chunk, from its rows."""
    tokens, logprobs, top, offsets = (msgspec.Raw(b"[" + b",".join(column) + b"]") for column in _transposed(rows))
    return p.CompletionLogprobs(
        tokens=cast("list[str]", tokens),
        token_logprobs=cast("list[float | None]", logprobs),
        top_logprobs=cast("list[dict[str, float] | None]", top),
        text_offset=cast("list[int]", offsets),
    )


def _prompt_texts(model: ChatModel, data: p.CompletionRequest) -> list[str]:
    """The text each prompt echoes: as sent, or its token ids decoded (as output is: special
    tokens skipped). Called once the streams started, so the ids are known to be valid."""
    return [prompt if isinstance(prompt, str) else model.decode(prompt) for prompt in completion_prompts(data.prompt)]
