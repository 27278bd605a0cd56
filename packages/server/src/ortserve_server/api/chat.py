"""``POST /v1/chat/completions`` (a Whisper model answers with the transcription)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import msgspec
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p
from ortserve_runtime import (
    InvalidRequestError,
    TokenLogprob,
    ToolCall,
)

from .._connection import while_connected
from .._errors import (
    BadRequestError,
)
from .._generation import SPLICE, Generation, encode_json, include_usage, json_answer, sse_event, stream_response
from .._ids import new_id
from .._leases import require_model, require_speech_model
from .._messages import adecode_base64
from .._openapi import generation_docs
from .._plan import check_chat_request, start_chat
from .._record import note
from .._state import OrtServe

__all__ = ["chat_completions"]


@post(
    "/chat/completions",
    status_code=200,
    summary="Create a chat completion",
    **generation_docs(p.ChatCompletion, "The chat completion"),
)
async def chat_completions(
    data: JSONBody[p.ChatCompletionRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[Any]:
    if data.model in ortserve.registry.names() and ortserve.registry.kind(data.model) == "speech":
        return await _transcribe_chat(data, ortserve, request)
    model = await require_model(ortserve, data.model, data.keep_alive)
    run = Generation(
        ortserve, f"{ortserve.config.path}/chat/completions", await start_chat(ortserve, model, data, request)
    )
    n = run.choices_per_prompt
    response_id, created = new_id("chatcmpl-"), int(time.time())
    note(response_id=response_id)
    call_ids: dict[tuple[int, int], str] = {}

    def call_id(choice: int, number: int) -> str:
        return call_ids.setdefault((choice, number), "call_" + uuid.uuid4().hex[:24])

    def chunk(choices: list[p.ChatCompletionChunkChoice], usage: p.CompletionUsage | None = None) -> bytes:
        return sse_event(
            p.ChatCompletionChunk(id=response_id, created=created, model=data.model, choices=choices, usage=usage)
        )

    def delta(index: int, **fields: Any) -> bytes:
        return chunk([p.ChatCompletionChunkChoice(index=index, delta=p.ChoiceDelta(**fields))])

    def events(index: int, text: str, calls: list[ToolCall], reason: str | None) -> list[bytes]:
        scored = run.event_logprobs
        out = []
        if run.event_reasoning:  # both names: llama-server's (older vLLM's) and vLLM's
            thought = run.event_reasoning
            out.append(delta(index, reasoning_content=thought, reasoning=thought))
        if scored is not None:  # a token's chunk carries its logprobs, even while text is held back
            logprobs = _chat_logprobs([scored])
            out.append(
                chunk([p.ChatCompletionChunkChoice(index=index, delta=p.ChoiceDelta(content=text), logprobs=logprobs)])
            )
        elif text:
            out.append(delta(index, content=text))
        first = run.calls_made[index] - len(calls)
        for number, call in enumerate(calls, start=first):
            # OpenAI's shape: id, type and name first, then the arguments as fragments.
            opening = p.ChoiceDeltaToolCall(
                index=number,
                id=call_id(index, number),
                type="function",
                function=p.ChoiceDeltaFunctionCall(name=call.name, arguments=""),
            )
            out.append(delta(index, tool_calls=[opening]))
            arguments = p.ChoiceDeltaFunctionCall(arguments=call.arguments)
            out.append(delta(index, tool_calls=[p.ChoiceDeltaToolCall(index=number, function=arguments)]))
        if reason is not None:
            finish = p.ChatCompletionChunkChoice(index=index, delta=p.ChoiceDelta(), finish_reason=reason)
            out.append(chunk([finish]))
        return out

    if data.stream is True:
        opening = [delta(i, role="assistant", content="") for i in range(n)]
        usage_chunk = (lambda usage: chunk([], usage)) if include_usage(data.stream_options) else None
        return stream_response(run.sse(events, usage_chunk, opening))
    encode = (lambda _, item: encode_json(_chat_logprob(item))) if data.logprobs is True else None
    texts, calls, finish, usage = await while_connected(request, ortserve, run.collect(encode_logprobs=encode))

    choices = _choices(data, run, texts, calls, finish, call_id)
    answer = p.ChatCompletion(id=response_id, created=created, model=data.model, choices=choices, usage=usage)
    if data.logprobs is True:  # the tokens' logprobs make it large: spliced in off the loop
        return await json_answer(lambda: (answer, run.encoded_logprobs))
    return Response(answer)


def _choices(
    data: p.ChatCompletionRequest,
    run: Generation,
    texts: list[str],
    calls: list[list[ToolCall]],
    finish: list[str],
    call_id: Callable[[int, int], str],
) -> list[p.ChatCompletionChoice]:
    """The choices of a chat answer not streamed, from what :meth:`Generation.collect` gave;
    each choice's logprobs (when asked for) a :data:`SPLICE` for its encoded tokens."""
    choices = []
    for i, (text, made, reason) in enumerate(zip(texts, calls, finish, strict=True)):
        tool_calls = [
            p.ToolCall(id=call_id(i, k), function=p.FunctionCall(name=c.name, arguments=c.arguments))
            for k, c in enumerate(made)
        ]
        message = p.ChatCompletionMessage(
            role="assistant",
            content=text if text or not tool_calls else None,
            tool_calls=tool_calls or msgspec.UNSET,
        )
        if run.reasoning_parsers is not None:
            message.reasoning_content = message.reasoning = run.reasonings[i]
        logprobs = None
        if data.logprobs is True:  # the tokens' JSON, encoded as they came (see Generation.collect)
            logprobs = p.ChoiceLogprobs(content=cast("list[p.ChatCompletionTokenLogprob]", SPLICE))
        choices.append(p.ChatCompletionChoice(index=i, message=message, finish_reason=reason, logprobs=logprobs))
    return choices


async def _transcribe_chat(
    data: p.ChatCompletionRequest, ortserve: OrtServe, request: Request[Any, Any, Any]
) -> Response[Any]:
    """A chat with a speech-to-text model: its answer is the transcription of the one
    ``input_audio`` part the messages carry (text parts are not instructions to it)."""
    model = await require_speech_model(ortserve, data.model, data.keep_alive)
    check_chat_request(data, ortserve.config)
    for name in ("tools", "response_format", "stop", "reasoning_effort", "chat_template_kwargs"):
        if getattr(data, name) not in (None, msgspec.UNSET, [], {}):
            raise BadRequestError(f"'{name}' does not apply to a speech-to-text model", param=name)
    if data.n not in (None, msgspec.UNSET, 1):
        raise BadRequestError("a speech-to-text model gives one choice ('n' must be 1)", param="n")
    # Whisper decodes in onnxruntime-genai: there are no logits here to score or bias.
    sampling = {
        "logprobs": data.logprobs is True,
        "logit_bias": bool(data.logit_bias),
        "min_p": data.min_p not in (None, msgspec.UNSET, 0),
        "presence_penalty": data.presence_penalty not in (None, msgspec.UNSET, 0),
        "frequency_penalty": data.frequency_penalty not in (None, msgspec.UNSET, 0),
    }
    for name, asked in sampling.items():
        if asked:
            raise BadRequestError(f"'{name}' does not apply to a speech-to-text model", param=name)
    audio = [
        (f"messages[{i}].content[{j}].input_audio.data", part.input_audio.data)
        for i, message in enumerate(data.messages)
        if isinstance(message.content, list)
        for j, part in enumerate(message.content)
        if isinstance(part, p.InputAudioContentPart)
    ]
    if len(audio) != 1:
        raise BadRequestError(
            f"model {data.model!r} transcribes speech: send exactly one input_audio part (got {len(audio)})",
            param="messages",
        )
    where, encoded = audio[0]
    max_tokens = data.max_completion_tokens if isinstance(data.max_completion_tokens, int) else data.max_tokens
    try:
        result = await while_connected(
            request,
            ortserve,
            model.transcribe(
                await adecode_base64(encoded, where),
                temperature=data.temperature if isinstance(data.temperature, float | int) else 0.0,
                max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            ),
        )
    except InvalidRequestError as exc:  # the runtime names the transcription API's "file"
        raise InvalidRequestError(str(exc), param=where if exc.param == "file" else exc.param) from exc
    endpoint = f"{ortserve.config.path}/chat/completions"
    ortserve.metrics.count_request(endpoint, data.model, 200)
    ortserve.metrics.completion_tokens.labels(data.model).inc(result.tokens)
    note(model=data.model, output_tokens=result.tokens)
    reason = "length" if isinstance(max_tokens, int) and result.tokens >= max_tokens else "stop"
    usage = p.CompletionUsage(prompt_tokens=0, completion_tokens=result.tokens, total_tokens=result.tokens)
    response_id, created = new_id("chatcmpl-"), int(time.time())
    if data.stream is not True:
        message = p.ChatCompletionMessage(role="assistant", content=result.text)
        choice = p.ChatCompletionChoice(index=0, message=message, finish_reason=reason)
        return Response(
            p.ChatCompletion(id=response_id, created=created, model=data.model, choices=[choice], usage=usage)
        )

    def chunk(choices: list[p.ChatCompletionChunkChoice], usage: p.CompletionUsage | None = None) -> bytes:
        return sse_event(
            p.ChatCompletionChunk(id=response_id, created=created, model=data.model, choices=choices, usage=usage)
        )

    async def events() -> AsyncIterator[bytes]:
        yield chunk([p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(role="assistant", content=result.text))])
        yield chunk([p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(), finish_reason=reason)])
        if include_usage(data.stream_options):
            yield chunk([], usage)
        yield b"data: [DONE]\n\n"

    return stream_response(events())


def _chat_logprob(item: TokenLogprob) -> p.ChatCompletionTokenLogprob:
    return p.ChatCompletionTokenLogprob(
        token=item.text,
        logprob=item.logprob,
        bytes=list(item.bytes),
        top_logprobs=[p.TopLogprob(token=t.text, logprob=t.logprob, bytes=list(t.bytes)) for t in item.top],
    )


def _chat_logprobs(items: list[TokenLogprob]) -> p.ChoiceLogprobs:
    return p.ChoiceLogprobs(content=[_chat_logprob(item) for item in items])
