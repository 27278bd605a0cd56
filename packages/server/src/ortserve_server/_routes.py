"""Route handlers: OpenAI requests in, runtime calls, OpenAI responses out.

All mapping between the wire protocol (``ortserve_client.protocol``) and the runtime
(``ortserve_runtime``) lives in this module and ``_mapping``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import UploadFile
from litestar.di import NamedDependency
from litestar.handlers import BaseRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, JSONBody, MultipartBody
from litestar.response import Stream
from ortserve_client import protocol as p
from ortserve_runtime import (
    AdapterNotFoundError,
    ChatModel,
    GenerationEvent,
    GenerationStream,
    InvalidRequestError,
    Prompt,
    ReasoningParser,
    RerankModel,
    RerankResult,
    Segment,
    TokenLogprob,
    ToolCall,
    ToolCallParser,
)

from ._errors import (
    AuthenticationError,
    BadRequestError,
    ClientDisconnectedError,
    ServerError,
    ShuttingDownError,
    unavailable_detail,
)
from ._ids import new_id
from ._mapping import (
    CALLER,
    Caller,
    GenerationPlan,
    caller_of,
    chat_messages,
    check_chat_request,
    check_room,
    completion_prompts,
    decode_base64,
    model_adapters,
    plan_chat,
    plan_completion,
    require_embedding_model,
    require_model,
    require_rerank_model,
    require_speech_model,
    split_adapter,
    template_kwargs,
)
from ._openapi import GET_ERRORS, POST_ERRORS, also_sends, error_responses, generation_docs, with_error_responses
from ._state import OrtServe

__all__ = [
    "api_route_handlers",
    "health_handler",
    "make_auth_guard",
    "metrics_handler",
    "model_card",
    "rerank_alias_handlers",
]

_encode = msgspec.json.Encoder().encode
T = TypeVar("T")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def make_auth_guard(api_keys: Sequence[str], *, x_api_key: bool = False, scoped: bool = False) -> Any:
    """A guard that wants ``Authorization: Bearer <key>`` for one of ``api_keys`` (or, with
    ``x_api_key``, the ``x-api-key`` header Anthropic's clients send), compared in constant
    time. It records which key came (:data:`CALLER`): files and batches belong to it, and
    with ``scoped`` it is the prefix cache's scope too."""
    expected = [(key.encode(), hashlib.sha256(key.encode()).hexdigest()) for key in api_keys]
    ask = "'x-api-key: <key>' or 'Authorization: Bearer <key>'" if x_api_key else "'Authorization: Bearer <key>'"

    def matching(given: str) -> str | None:
        found = None
        for key, digest in expected:  # every key compared: the time does not tell which matched
            if hmac.compare_digest(given.strip().encode(), key):
                found = digest
        return found

    def auth_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        given_key = connection.headers.get("x-api-key") if x_api_key else None
        digest = matching(given_key) if given_key is not None else None
        if digest is None:
            scheme, _sep, given = connection.headers.get("authorization", "").partition(" ")
            digest = matching(given) if scheme.lower() == "bearer" else None
        if digest is None:
            raise AuthenticationError(f"missing or wrong API key: send {ask}")
        caller = Caller(owner=digest, cache_scope=digest if scoped else None)
        connection.scope[CALLER] = caller  # type: ignore[literal-required]

    return auth_guard


def _sse(payload: Any) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


async def _while_connected(request: Request[Any, Any, Any], state: OrtServe, work: Awaitable[T]) -> T:
    """``work``, cancelled if the client disconnects first (a non-streamed generation or
    transcription stops and frees its slot, as a streamed one does when its stream
    closes), or if a shutdown cuts work off (then a 503 answers)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    with state.cut_signal() as cut:
        try:
            waiting: set[asyncio.Future[Any]] = {task, gone, cut}
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        was_cut = cut.done() and not cut.cancelled()
    if task.cancelled():
        if was_cut:
            state.cut_requests += 1
            raise ShuttingDownError("the server is shutting down; the request was cut off")
        raise ClientDisconnectedError("the client disconnected before the answer was ready")
    return task.result()


def fetching_while_connected(
    request: Request[Any, Any, Any] | None, state: OrtServe
) -> Callable[[Awaitable[None]], Awaitable[None]] | None:
    """What :func:`chat_messages` runs its remote image fetches through: stopped when the
    client leaves (``None`` without a request)."""
    if request is None:
        return None
    return lambda work: _while_connected(request, state, work)


async def _disconnected(request: Request[Any, Any, Any]) -> None:
    """Returns when the server reports the client gone (the body was read already, so
    ``receive`` has nothing else to say; under WSGI it never returns)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _merge(
    streams: list[GenerationStream], cut: asyncio.Future[None] | None = None
) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Events of several streams as they come, tagged with the stream's index; once
    ``cut`` resolves, :class:`ShuttingDownError` instead of the next event."""
    if len(streams) == 1 and cut is None:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, GenerationEvent | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: GenerationStream) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
            await queue.put((index, None))
        except BaseException as exc:  # noqa: BLE001  # handed to the consumer below
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]

    def on_cut(done: asyncio.Future[None]) -> None:
        if not done.cancelled():
            queue.put_nowait((-1, ShuttingDownError("the server is shutting down; the generation was cut off")))

    if cut is not None:
        cut.add_done_callback(on_cut)
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


class _Generation:
    """The streams of one generation request, with its metrics (time to first token,
    tokens, outcome) and the two ways to deliver it: collected, or as SSE chunks."""

    def __init__(
        self,
        state: OrtServe,
        endpoint: str,
        model: ChatModel,
        streams: list[GenerationStream],
        tool_parsers: list[ToolCallParser] | None = None,
        parallel_calls: bool = True,
        forced_tool: str | None = None,
    ) -> None:
        self.state = state
        self.metrics = state.metrics
        self.endpoint = endpoint
        self.model = model
        self.streams = streams
        self.tool_parsers = tool_parsers
        self.parallel_calls = parallel_calls
        self.forced_tool = forced_tool
        """The function a forced call calls (``""``: any; ``None``: not forced)."""
        self.calls_made = [0] * len(streams)
        self.prompt_tokens = sum(s.prompt_tokens for s in streams)
        self.choices_per_prompt = 1
        self.cached = [0] * len(streams)
        """Per stream, the prompt tokens its engine took from the prefix cache."""
        self.stop_sequences: list[str | None] = [None] * len(streams)
        """Per stream, the stop string that ended it (once it ended on one)."""
        self.start = time.perf_counter()
        self.first = True
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in streams]
        """Per stream, its tokens' log-probabilities, when asked for (:meth:`collect`)."""
        self.event_logprobs: TokenLogprob | None = None
        """Those of the event that :meth:`sse`'s ``events`` callback is turning into chunks."""
        self.reasoning_parsers: list[ReasoningParser] | None = None
        """Per stream, the splitter of a reasoning model's thinking from its answer."""
        self.event_reasoning = ""
        """The thinking of the event :meth:`_split` split last (content is the answer only)."""
        self.reasonings = [""] * len(streams)
        """Per stream, all its thinking (:meth:`collect`)."""
        self.drafts = [(0, 0)] * len(streams)
        """Per stream, its accepted and rejected draft tokens (speculative decoding)."""
        self.reasoning_tokens = [0] * len(streams)
        """Per stream, the tokens generated inside its think block (markers included):
        the Responses API's ``reasoning_tokens``."""
        self.plan: GenerationPlan | None = None
        """The plan that started the streams: names the request's field in errors raised
        mid-generation (a grammar the matcher gave up on: ``response_format``...)."""

    async def _events(self, cut: Any = None) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """:func:`_merge` of the streams, with a refusal naming the request's field."""
        try:
            async for item in _merge(self.streams, cut) if cut is not None else _merge(self.streams):
                yield item
        except InvalidRequestError as exc:
            if self.plan is None:
                raise
            raise self.plan.named(exc) from exc

    def split_reasoning(self, prompt: Prompt) -> None:
        """Split each stream's thinking from its answer when the model reasons and the
        prompt left thinking on (a template that closed the block leaves only answer)."""
        if self.model.reasoning is not None and prompt.reasoning is not None:
            self.reasoning_parsers = [ReasoningParser(self.model.reasoning, prompt.reasoning) for _ in self.streams]

    def _observe(self, event: GenerationEvent) -> None:
        if self.first and event.token_id is not None:
            self.first = False
            self.metrics.time_to_first_token.labels(self.model.name).observe(time.perf_counter() - self.start)

    def _split(self, index: int, event: GenerationEvent) -> tuple[str, list[ToolCall], str | None]:
        """The event as content, completed tool calls and finish reason (``tool_calls``
        when the choice called a tool); a reasoning model's thinking goes to
        :attr:`event_reasoning`, and only the answer after it is parsed for calls."""
        text, self.event_reasoning = event.text, ""
        if self.reasoning_parsers is not None:
            splitter = self.reasoning_parsers[index]
            # A token is reasoning if the block was open before it (it may close it) or
            # after it (it opened it); the held-back text does not matter for counting.
            was_in = splitter.in_reasoning
            self.event_reasoning, text = splitter.feed(text)
            if event.token_id is not None and (was_in or splitter.in_reasoning):
                self.reasoning_tokens[index] += 1
            if event.finish_reason is not None:
                thought, answer = splitter.finish()
                self.event_reasoning, text = self.event_reasoning + thought, text + answer
        if self.tool_parsers is None:
            return text, [], event.finish_reason
        parser = self.tool_parsers[index]
        text, calls = parser.feed(text)
        if event.finish_reason is not None:
            # A call cut short by max_tokens is still a call (arguments as written so far).
            rest, more = parser.finish(cut_short=event.finish_reason == "length", forced=self.forced_tool)
            text, calls = text + rest, calls + more
        if not self.parallel_calls:  # parallel_tool_calls=false: the first call only
            calls = calls[: max(0, 1 - self.calls_made[index])]
        self.calls_made[index] += len(calls)
        if event.finish_reason == "stop" and self.calls_made[index]:
            return text, calls, "tool_calls"
        return text, calls, event.finish_reason

    def _record(self, index: int, event: GenerationEvent) -> int:
        """Completion tokens of a final event (0 before the end); notes its cached tokens."""
        if event.usage is None:
            return 0
        self.cached[index] = event.usage.cached_tokens
        self.drafts[index] = (event.usage.accepted_prediction_tokens, event.usage.rejected_prediction_tokens)
        self.stop_sequences[index] = event.stop_sequence
        return event.usage.completion_tokens

    def _done(self, completion_tokens: int, status: int = 200) -> p.CompletionUsage:
        name = self.model.name
        self.metrics.count_request(self.endpoint, name, status)
        self.metrics.prompt_tokens.labels(name).inc(self.prompt_tokens)
        self.metrics.completion_tokens.labels(name).inc(completion_tokens)
        # A prompt counts once however many choices it has: its cached part is what every
        # choice found cached (the first choice may have put it there for the others).
        per = self.choices_per_prompt
        cached = sum(min(self.cached[i : i + per]) for i in range(0, len(self.cached), per))
        accepted = sum(a for a, _ in self.drafts)
        rejected = sum(r for _, r in self.drafts)
        self.metrics.count_drafts(name, accepted, rejected)
        return p.CompletionUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=self.prompt_tokens + completion_tokens,
            prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached),
            completion_tokens_details=(
                p.CompletionTokensDetails(
                    reasoning_tokens=sum(self.reasoning_tokens),
                    accepted_prediction_tokens=accepted,
                    rejected_prediction_tokens=rejected,
                )
                if self.reasoning_parsers is not None or accepted or rejected
                else None
            ),
        )

    async def collect(self) -> tuple[list[str], list[list[ToolCall]], list[str], p.CompletionUsage]:
        """Every stream to the end: texts, tool calls, finish reasons, usage."""
        texts = [""] * len(self.streams)
        calls: list[list[ToolCall]] = [[] for _ in self.streams]
        finish = ["stop"] * len(self.streams)
        completion_tokens = 0
        async for index, event in self._events():
            self._observe(event)
            text, made, reason = self._split(index, event)
            self.reasonings[index] += self.event_reasoning
            texts[index] += text
            calls[index] += made
            completion_tokens += self._record(index, event)
            if event.logprobs is not None:
                self.logprobs[index].append(event.logprobs)
            if reason is not None:
                finish[index] = reason
        return texts, calls, finish, self._done(completion_tokens)

    async def sse(
        self,
        events: Callable[[int, str, list[ToolCall], str | None], list[bytes]],
        usage_chunk: Callable[[p.CompletionUsage], bytes] | None,
        opening: list[bytes] = [],  # noqa: B006  # read only
        *,
        error_event: Callable[[Exception], bytes] | None = None,
        closing: bytes = b"data: [DONE]\n\n",
    ) -> AsyncIterator[bytes]:
        """Server-sent events: ``opening``, the chunks ``events`` makes of each event (as
        content, tool calls and finish reason), the usage chunk when asked for, then
        ``closing`` (``[DONE]``; empty for API families without it). Errors after the headers
        went out are reported in-band, as OpenAI does, or as ``error_event`` frames them for
        another API family."""
        for chunk in opening:
            yield chunk
        completion_tokens = 0
        try:
            with self.state.cut_signal() as cut:
                async for index, event in self._events(cut):
                    self._observe(event)
                    completion_tokens += self._record(index, event)
                    self.event_logprobs = event.logprobs
                    for chunk in events(index, *self._split(index, event)):
                        yield chunk
        except Exception as exc:  # noqa: BLE001  # the stream has started: say so in-band
            if isinstance(exc, ShuttingDownError):
                self.state.cut_requests += 1
            self._done(completion_tokens, exc.status_code if isinstance(exc, ServerError) else 500)
            yield (error_event or _openai_error_chunk)(exc)
        else:
            usage = self._done(completion_tokens)
            if usage_chunk is not None:
                yield usage_chunk(usage)
        if closing:
            yield closing


def error_detail(exc: Exception) -> p.ErrorDetail:
    """An error in a stream that has started, as OpenAI's error body describes it (the
    message of an unexpected error reveals nothing internal)."""
    if isinstance(exc, ServerError):
        return p.ErrorDetail(message=exc.message, type=exc.type, code=exc.code)
    return unavailable_detail(exc) or p.ErrorDetail(message="the generation failed", type="server_error")


def _openai_error_chunk(exc: Exception) -> bytes:
    return _sse(p.ErrorResponse(error=error_detail(exc)))


async def start_chat(
    ortserve: OrtServe,
    model: ChatModel,
    data: p.ChatCompletionRequest,
    endpoint: str,
    request: Request[Any, Any, Any] | None = None,
    fit: bool = False,
) -> _Generation:
    """A chat request checked, its prompt prepared and its generations started: what every
    API family that speaks in messages (chat completions, Responses) runs the same way.
    ``fit``: cut ``max_tokens`` to the room the prompt leaves (a tool loop's later turn)."""
    plan = plan_chat(data, model, ortserve.config, caller_of(request))
    tools = plan.tools
    check_room(ortserve, model, plan.n, "n", "generations")  # before the prompt is prepared
    prompt = await model.aprepare_chat(
        await chat_messages(data.messages, ortserve.config, model, fetching_while_connected(request, ortserve)),
        tools=tools.definitions,
        template_kwargs=template_kwargs(data),
    )
    if fit:
        plan = plan.fitted(model, prompt)
    streams = await plan.astart(ortserve, model, [prompt])
    parsers = [ToolCallParser(tools.format) for _ in streams] if tools.format else None
    run = _Generation(ortserve, endpoint, model, streams, parsers, data.parallel_tool_calls is not False, tools.forced)
    run.plan = plan
    run.split_reasoning(prompt)
    run.prompt_tokens = len(prompt)  # the n choices share one prompt
    run.choices_per_prompt = plan.n
    return run


def _chat_logprobs(items: list[TokenLogprob]) -> p.ChoiceLogprobs:
    return p.ChoiceLogprobs(
        content=[
            p.ChatCompletionTokenLogprob(
                token=item.text,
                logprob=item.logprob,
                bytes=list(item.bytes),
                top_logprobs=[p.TopLogprob(token=t.text, logprob=t.logprob, bytes=list(t.bytes)) for t in item.top],
            )
            for item in items
        ]
    )


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


def _include_usage(options: p.StreamOptions | msgspec.UnsetType | None) -> bool:
    return isinstance(options, p.StreamOptions) and options.include_usage


def _stream_response(chunks: AsyncIterator[bytes]) -> Stream:
    return Stream(chunks, media_type="text/event-stream", headers=_SSE_HEADERS)


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
    run = await start_chat(ortserve, model, data, f"{ortserve.config.path}/chat/completions", request)
    n = run.choices_per_prompt
    response_id, created = new_id("chatcmpl-"), int(time.time())
    call_ids: dict[tuple[int, int], str] = {}

    def call_id(choice: int, number: int) -> str:
        return call_ids.setdefault((choice, number), "call_" + uuid.uuid4().hex[:24])

    def chunk(choices: list[p.ChatCompletionChunkChoice], usage: p.CompletionUsage | None = None) -> bytes:
        return _sse(
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
        usage_chunk = (lambda usage: chunk([], usage)) if _include_usage(data.stream_options) else None
        return _stream_response(run.sse(events, usage_chunk, opening))
    texts, calls, finish, usage = await _while_connected(request, ortserve, run.collect())
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
        logprobs = _chat_logprobs(run.logprobs[i]) if data.logprobs is True else None
        choices.append(p.ChatCompletionChoice(index=i, message=message, finish_reason=reason, logprobs=logprobs))
    return Response(p.ChatCompletion(id=response_id, created=created, model=data.model, choices=choices, usage=usage))


async def _transcribe_chat(
    data: p.ChatCompletionRequest, ortserve: OrtServe, request: Request[Any, Any, Any]
) -> Response[Any]:
    """A chat with a speech-to-text model: its answer is the transcription of the one
    ``input_audio`` part the messages carry (text parts are not instructions to it)."""
    model = await require_speech_model(ortserve, data.model, data.keep_alive)
    check_chat_request(data, ortserve.config)
    for name in ("tools", "response_format", "stop"):
        if getattr(data, name) not in (None, msgspec.UNSET, []):
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
        result = await _while_connected(
            request,
            ortserve,
            model.transcribe(
                decode_base64(encoded, where),
                temperature=data.temperature if isinstance(data.temperature, float | int) else 0.0,
                max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            ),
        )
    except InvalidRequestError as exc:  # the runtime names the transcription API's "file"
        raise InvalidRequestError(str(exc), param=where if exc.param == "file" else exc.param) from exc
    endpoint = f"{ortserve.config.path}/chat/completions"
    ortserve.metrics.count_request(endpoint, data.model, 200)
    ortserve.metrics.completion_tokens.labels(data.model).inc(result.tokens)
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
        return _sse(
            p.ChatCompletionChunk(id=response_id, created=created, model=data.model, choices=choices, usage=usage)
        )

    async def events() -> AsyncIterator[bytes]:
        yield chunk([p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(role="assistant", content=result.text))])
        yield chunk([p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(), finish_reason=reason)])
        if _include_usage(data.stream_options):
            yield chunk([], usage)
        yield b"data: [DONE]\n\n"

    return _stream_response(events())


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
    plan = plan_completion(data, ortserve.config, caller_of(request))
    n = plan.n
    streams = await plan.astart(ortserve, model, completion_prompts(data.prompt))
    run = _Generation(ortserve, f"{ortserve.config.path}/completions", model, streams)
    run.plan = plan
    run.prompt_tokens //= n  # each prompt counts once, however many choices it has
    run.choices_per_prompt = n
    response_id, created = new_id("cmpl-"), int(time.time())

    def chunk(choices: list[p.CompletionChoice], usage: p.CompletionUsage | None = None) -> bytes:
        return _sse(p.Completion(id=response_id, created=created, model=data.model, choices=choices, usage=usage))

    def events(index: int, text: str, _: list[ToolCall], reason: str | None) -> list[bytes]:
        scored = run.event_logprobs
        if not text and reason is None and scored is None:
            return []
        logprobs = _completion_logprobs([scored]) if scored is not None else None
        return [chunk([p.CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=logprobs)])]

    if data.stream is True:
        usage_chunk = (lambda usage: chunk([], usage)) if _include_usage(data.stream_options) else None
        return _stream_response(run.sse(events, usage_chunk))
    texts, _, finish, usage = await _while_connected(request, ortserve, run.collect())
    wanted = isinstance(data.logprobs, int)
    choices = [
        p.CompletionChoice(
            index=i, text=t, finish_reason=f, logprobs=_completion_logprobs(run.logprobs[i]) if wanted else None
        )
        for i, (t, f) in enumerate(zip(texts, finish, strict=True))
    ]
    return Response(p.Completion(id=response_id, created=created, model=data.model, choices=choices, usage=usage))


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
    result = await _while_connected(
        request, ortserve, model.embed(data.input, truncate=truncate, dimensions=dimensions)
    )
    as_base64 = data.encoding_format == "base64"
    items = [
        p.Embedding(
            index=i,
            embedding=base64.b64encode(vector.astype("<f4").tobytes()).decode() if as_base64 else vector.tolist(),
        )
        for i, vector in enumerate(result.vectors)
    ]
    ortserve.metrics.count_request(f"{ortserve.config.path}/embeddings", data.model, 200)
    ortserve.metrics.prompt_tokens.labels(data.model).inc(result.prompt_tokens)
    usage = p.EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    return Response(p.CreateEmbeddingResponse(data=items, model=data.model, usage=usage))


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
    result = await _while_connected(request, ortserve, model.score(first, second, truncate=truncate, names=names))
    ortserve.metrics.count_request(f"{ortserve.config.path}/{route}", data.model, 200)
    ortserve.metrics.prompt_tokens.labels(data.model).inc(result.prompt_tokens)
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


@dataclass
class TranscriptionForm:
    """The multipart form of ``POST /v1/audio/transcriptions``."""

    model: str
    file: UploadFile | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0


_TRANSCRIPTION_FIELDS = {*TranscriptionForm.__dataclass_fields__, "timestamp_granularities[]"}


@post(
    "/audio/transcriptions",
    status_code=200,
    summary="Transcribe audio (speech-to-text models)",
    responses=with_error_responses(
        p.Transcription, "The transcript (verbose_json adds language, duration, segments)", *POST_ERRORS
    ),
    operation_class=also_sends("text/plain", "response_format text, srt or vtt"),
)
async def transcriptions(
    data: MultipartBody[TranscriptionForm], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> Response[Any]:
    model = await require_speech_model(ortserve, data.model)
    if data.file is None:
        raise BadRequestError("'file' is required: the audio to transcribe, as a multipart file", param="file")
    form = await request.form()
    unknown = sorted(set(form) - _TRANSCRIPTION_FIELDS)
    if unknown:  # stream, chunking_strategy, include[]...: refused rather than ignored
        raise BadRequestError(f"'{unknown[0]}' is not supported by this server", param=unknown[0].removesuffix("[]"))
    # A list field in a form: the SDKs send "timestamp_granularities[]" once per value.
    granularities = form.getall("timestamp_granularities[]", [])
    if "word" in granularities:
        raise BadRequestError("word timestamps are not supported; segments are", param="timestamp_granularities")
    if data.response_format not in ("json", "text", "verbose_json", "srt", "vtt"):
        raise BadRequestError(
            f"response_format {data.response_format!r} is not supported; use json, text, verbose_json, srt or vtt",
            param="response_format",
        )
    audio = await data.file.read()
    timed = data.response_format in ("verbose_json", "srt", "vtt")
    result = await _while_connected(
        request,
        ortserve,
        model.transcribe(
            audio, language=data.language, prompt=data.prompt, temperature=data.temperature, timestamps=timed
        ),
    )
    ortserve.metrics.count_request(f"{ortserve.config.path}/audio/transcriptions", data.model, 200)
    ortserve.metrics.completion_tokens.labels(data.model).inc(result.tokens)
    if data.response_format == "text":
        return Response(result.text, media_type="text/plain")
    if data.response_format in ("srt", "vtt"):
        return Response(_subtitles(result.segments, data.response_format), media_type="text/plain")
    if data.response_format == "verbose_json":
        segments = [
            p.TranscriptionSegment(id=i, start=s.start, end=s.end, text=s.text, tokens=s.tokens)
            for i, s in enumerate(result.segments)
        ]
        verbose = p.TranscriptionVerbose(
            text=result.text, language=result.language, duration=result.duration, segments=segments
        )
        return Response(verbose)
    return Response(p.Transcription(text=result.text))


def _subtitles(segments: list[Segment], kind: str) -> str:
    """SubRip (numbered cues, ``00:00:01,500``) or WebVTT (``WEBVTT`` header, ``00:00:01.500``)."""

    def clock(seconds: float) -> str:
        millis = round(seconds * 1000)
        hours, millis = divmod(millis, 3_600_000)
        minutes, millis = divmod(millis, 60_000)
        secs, millis = divmod(millis, 1000)
        return f"{hours:02d}:{minutes:02d}:{secs:02d}{',' if kind == 'srt' else '.'}{millis:03d}"

    cues = [f"{clock(s.start)} --> {clock(s.end)}\n{s.text}\n" for s in segments if s.text]
    if kind == "srt":
        return "\n".join(f"{number}\n{cue}" for number, cue in enumerate(cues, start=1))
    return "WEBVTT\n\n" + "\n".join(cues)


@get("/models", summary="List models", responses=error_responses(*GET_ERRORS))
async def list_models(ortserve: NamedDependency[OrtServe]) -> p.ModelList:
    cards = []
    for name in ortserve.registry.names():
        cards.append(model_card(ortserve, name))
        cards.extend(model_card(ortserve, name, adapter) for adapter in model_adapters(ortserve, name))
    return p.ModelList(data=cards)


@get("/models/{model_id:path}", summary="Retrieve a model", responses=error_responses(404, *GET_ERRORS))
async def retrieve_model(model_id: FromPath[str], ortserve: NamedDependency[OrtServe]) -> p.Model:
    name, adapter = split_adapter(ortserve, model_id.lstrip("/"))
    if name not in ortserve.registry.names():
        from ._errors import ModelNotFoundHTTPError

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


@post(
    "/tokenize",
    status_code=200,
    summary="Tokenize a prompt or chat messages (extension)",
    responses=error_responses(*POST_ERRORS),
)
async def tokenize(data: JSONBody[p.TokenizeRequest], ortserve: NamedDependency[OrtServe]) -> p.TokenizeResponse:
    model = await require_model(ortserve, data.model)
    has_prompt = not isinstance(data.prompt, msgspec.UnsetType)
    has_messages = not isinstance(data.messages, msgspec.UnsetType)
    if has_prompt == has_messages:
        raise BadRequestError("give exactly one of 'prompt' or 'messages'", param="prompt")
    if has_messages:
        assert not isinstance(data.messages, msgspec.UnsetType)
        messages = await chat_messages(data.messages, ortserve.config, model)
        tools = [msgspec.to_builtins(tool) for tool in data.tools] if isinstance(data.tools, list) else None
        prompt = await model.aprepare_chat(
            messages, tools=tools or None, add_generation_prompt=data.add_generation_prompt
        )
        tokens = list(prompt)  # a multimodal prompt counts each image as the features it becomes
    else:
        assert isinstance(data.prompt, str)
        model.check_prompt_size(data.prompt)  # too long to generate from: not worth tokenizing
        tokens = await asyncio.to_thread(model.encode, data.prompt)
    return p.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=model.max_sequence_length)


@post(
    "/detokenize",
    status_code=200,
    summary="Turn token ids back into text (extension)",
    responses=error_responses(*POST_ERRORS),
)
async def detokenize(data: JSONBody[p.DetokenizeRequest], ortserve: NamedDependency[OrtServe]) -> p.DetokenizeResponse:
    model = await require_model(ortserve, data.model)
    return p.DetokenizeResponse(prompt=await asyncio.to_thread(model.decode, data.tokens))


@get(
    "/",
    summary="Liveness and readiness",
    include_in_schema=True,
    responses={503: ResponseSpec(p.Health, description="Models loading or failed", generate_examples=False)}
    | error_responses(403),
)
async def health_handler(ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]) -> Response[p.Health]:
    statuses = ortserve.registry.status()
    overall = "ok"
    # Loading is "not ready" only while the models load at startup: a model that loads on
    # demand later (first use, or again after an unload) must not make probes fail.
    if ortserve.config.load_on_startup and not ortserve.started:
        overall = "loading"
    elif any(s.state == "error" for s in statuses):
        overall = "error"
    body = p.Health(
        status=overall,
        models=[p.HealthModel(id=s.name, status=s.state, provider=s.provider, engine=s.engine) for s in statuses],
    )
    return Response(body, status_code=200 if overall == "ok" else 503, headers=_key_proof(ortserve, request))


PROOF_CHALLENGE = "x-ortserve-challenge"
PROOF = "x-ortserve-proof"


def _key_proof(ortserve: OrtServe, request: Request[Any, Any, Any]) -> dict[str, str]:
    """The answer to a client's challenge: HMAC-SHA256 of its nonce under the API key, so a
    client (``LocalServer``) can tell this server holds its key before it sends the key or a
    prompt; nothing is learnt of the key from it. No key, no proof."""
    challenge = request.headers.get(PROOF_CHALLENGE)
    keys = ortserve.config.api_keys
    if not keys or not challenge or len(challenge) > 128:
        return {}
    # one proof per accepted key (comma-separated): the client looks for its own
    return {PROOF: ",".join(hmac.new(k.encode(), challenge.encode(), "sha256").hexdigest() for k in keys)}


@get(
    "/",
    summary="Prometheus metrics",
    media_type="text/plain; version=0.0.4",
    responses=error_responses(*GET_ERRORS),
)
async def metrics_handler(ortserve: NamedDependency[OrtServe]) -> bytes:
    for name in ortserve.registry.names():
        model = ortserve.registry.loaded(name)  # every kind: generative, speech, embedding, rerank
        if model is None:
            ortserve.metrics.set_load(name, None, None)
        else:
            ortserve.metrics.set_load(name, model.queued, model.active)
    return ortserve.metrics.render()


api_route_handlers = [
    chat_completions,
    completions,
    embeddings,
    rerank,
    score,
    transcriptions,
    list_models,
    retrieve_model,
    tokenize,
    detokenize,
]
rerank_alias_handlers = [rerank_alias]
"""Served at the root, beside the API's own prefix."""
