"""What every generation route shares on the way back up: a started request's streams
(:class:`~._plan.Started`) merged and delivered, collected or as server-sent events, with
its metrics; a client that leaves (or a shutdown) stops the work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from litestar import MediaType, Response
from litestar.response import Stream
from ortserve_client import protocol as p
from ortserve_runtime import (
    GenerationEvent,
    GenerationStream,
    InvalidRequestError,
    PromptLogprobs,
    ReasoningParser,
    TokenLogprob,
    ToolCall,
)

from ._errors import (
    ServerError,
    ShuttingDownError,
    storage_full,
    unavailable_detail,
)
from ._plan import Started
from ._record import current, note
from ._state import OrtServe

__all__ = [
    "SPLICE",
    "Generation",
    "encode_json",
    "error_detail",
    "include_usage",
    "json_answer",
    "sse_event",
    "stream_response",
]


encode_json = msgspec.json.Encoder().encode
"""msgspec's JSON encoder, made once for the generation routes."""


T = TypeVar("T")


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_LINE_BREAKS_JSON_KEEPS = ((b"\xc2\x85", b"\\u0085"), (b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"))
"""NEL, LINE SEPARATOR and PARAGRAPH SEPARATOR: JSON may hold them raw, and msgspec writes
them so, but readers that split lines the way ``str.splitlines`` does (httpx's
``iter_lines``) break an event where a model wrote one."""


def sse_event(payload: Any, name: str | None = None) -> bytes:
    """``payload`` as one server-sent event (``event: name`` first, when named), its JSON
    on one line whoever splits it."""
    data = encode_json(payload)
    for raw, escaped in _LINE_BREAKS_JSON_KEEPS:
        if raw in data:
            data = data.replace(raw, escaped)
    return (b"event: " + name.encode() + b"\n" if name else b"") + b"data: " + data + b"\n\n"


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


class Generation:
    """The streams of one generation request, with its metrics (time to first token,
    tokens, outcome) and the two ways to deliver it: collected, or as SSE chunks."""

    def __init__(self, state: OrtServe, endpoint: str, started: Started) -> None:
        streams = started.streams
        self.state = state
        self.metrics = state.metrics
        self.endpoint = endpoint
        self.model = started.model
        self.streams = streams
        self.tool_parsers = started.tool_parsers
        self.parallel_calls = started.parallel_calls
        self.forced_tool = started.plan.tools.forced
        """The function a forced call calls (``""``: any; ``None``: not forced)."""
        self.calls_made = [0] * len(streams)
        self.prompt_tokens = started.prompt_tokens
        self.choices_per_prompt = started.plan.n
        self.cached = [0] * len(streams)
        """Per stream, the prompt tokens its engine took from the prefix cache."""
        self.stop_sequences: list[str | None] = [None] * len(streams)
        """Per stream, the stop string that ended it (once it ended on one)."""
        self.start = time.perf_counter()
        self.first = True
        self.record = current()
        """The request's record (log line, usage per key, spans), where there is one."""
        self.turn = self.record.open_turn(self.model.name) if self.record is not None else None
        """A tool loop's turn, as a span (tracing only)."""
        self.encoded_logprobs: list[list[Any]] = [[] for _ in streams]
        """Per stream, its tokens' log-probabilities as :meth:`collect`'s ``encode_logprobs``
        made them, when asked for."""
        self.event_logprobs: TokenLogprob | None = None
        """Those of the event that :meth:`sse`'s ``events`` callback is turning into chunks."""
        self.prompt_logprobs: list[PromptLogprobs | None] = [None] * len(streams)
        """Per stream, its prompt's tokens scored, when asked for (:meth:`collect`)."""
        self.event_prompt_logprobs: PromptLogprobs | None = None
        """Those that the event :meth:`sse`'s ``events`` callback is turning into chunks
        carries (a stream's first event)."""
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
        self.plan = started.plan
        self.predicted = any(options.prediction is not None for options in started.plan.options)
        """The plan that started the streams: names the request's field in errors raised
        mid-generation (a grammar the matcher gave up on: ``response_format``...)."""
        self.prompt_only = started.plan.prompt_only
        """The answer is the prompt alone: what the streams generate is dropped (and not counted)."""
        prompt = started.prompt
        if self.model.reasoning is not None and prompt is not None and prompt.reasoning is not None:
            # Each stream's thinking split from its answer: the model reasons and the prompt
            # left thinking on (a template that closed the block leaves only answer).
            self.reasoning_parsers = [ReasoningParser(self.model.reasoning, prompt.reasoning) for _ in streams]

    async def _events(self, cut: Any = None) -> AsyncIterator[tuple[int, GenerationEvent]]:
        """:func:`_merge` of the streams, with a refusal naming the request's field."""
        try:
            async for item in _merge(self.streams, cut) if cut is not None else _merge(self.streams):
                yield item
        except InvalidRequestError as exc:
            raise self.plan.named(exc) from exc

    def _observe(self, event: GenerationEvent) -> None:
        if self.first and event.token_id is not None:
            self.first = False
            now = time.perf_counter()
            self.metrics.time_to_first_token.labels(self.model.name).observe(now - self.start)
            if self.record is not None and self.record.first_token is None:
                self.record.first_token = now

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
        if self.record is not None:
            self.record.generated(index, event.usage, self.model.name, self.turn)
        self.cached[index] = event.usage.cached_tokens
        self.drafts[index] = (event.usage.accepted_prediction_tokens, event.usage.rejected_prediction_tokens)
        self.stop_sequences[index] = event.stop_sequence
        return 0 if self.prompt_only else event.usage.completion_tokens

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
        note(model=name, input_tokens=self.prompt_tokens, output_tokens=completion_tokens, cached_tokens=cached)
        if self.record is not None:
            self.record.close_turn(self.turn)
            self.turn = None
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
                # OpenAI reports both prediction counts whenever a prediction is given, 0s too.
                if self.reasoning_parsers is not None or accepted or rejected or self.predicted
                else None
            ),
        )

    async def collect(
        self, *, encode_logprobs: Callable[[int, TokenLogprob], Any] | None = None
    ) -> tuple[list[str], list[list[ToolCall]], list[str], p.CompletionUsage]:
        """Every stream to the end: texts, tool calls, finish reasons, usage; with
        ``encode_logprobs``, what it makes of each token's log-probabilities (given the
        stream's index: the answer's JSON for them) into :attr:`encoded_logprobs`, as they
        come. Encoded, an answer's thousands of them are no objects to build at the end: n=8 x
        900 tokens with 20 alternatives each made 300,000 objects whose building, and the
        garbage collector's passes over them, held the event loop 640-790 ms at once."""
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
            if event.logprobs is not None and encode_logprobs is not None:
                self.encoded_logprobs[index].append(encode_logprobs(index, event.logprobs))
            if event.prompt_logprobs is not None:
                self.prompt_logprobs[index] = event.prompt_logprobs
            if reason is not None:
                finish[index] = reason
        note(finish_reasons=finish)
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
        finish: list[str] = ["stop"] * len(self.streams)
        try:
            with self.state.cut_signal() as cut:
                async for index, event in self._events(cut):
                    self._observe(event)
                    completion_tokens += self._record(index, event)
                    self.event_logprobs = event.logprobs
                    self.event_prompt_logprobs = event.prompt_logprobs
                    parts = self._split(index, event)
                    if parts[2] is not None:
                        finish[index] = parts[2]
                    for chunk in events(index, *parts):
                        yield chunk
            note(finish_reasons=finish)
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
    server_error = exc if isinstance(exc, ServerError) else storage_full(exc)
    if server_error is not None:
        return p.ErrorDetail(message=server_error.message, type=server_error.type, code=server_error.code)
    return unavailable_detail(exc) or p.ErrorDetail(message="the generation failed", type="server_error")


def _openai_error_chunk(exc: Exception) -> bytes:
    record = current()
    request_id = record.id if record is not None else msgspec.UNSET  # as the error bodies have it
    return sse_event(p.ErrorResponse(error=error_detail(exc), request_id=request_id))


def include_usage(options: p.StreamOptions | msgspec.UnsetType | None) -> bool:
    return isinstance(options, p.StreamOptions) and options.include_usage


SPLICE = msgspec.Raw(b"\x00")
"""Stands for a JSON array in an answer :func:`json_answer` makes: encoded JSON has no raw
NUL byte anywhere else (strings escape it), so the places to splice are exact."""

_ANSWER_CHUNK = 1 << 20
# Large answers are made one at a time: each builder is one more thread asking for the GIL,
# and the event loop waits behind every one of them (four at once held /health 22-46 ms
# per acquisition).
_answer_maker = ThreadPoolExecutor(1, thread_name_prefix="ortserve-answer")


async def json_answer(make: Callable[[], tuple[Any, Sequence[Sequence[bytes]]]]) -> Response[Any]:
    """A large JSON answer, made off the event loop and sent in pieces: ``make`` (run on a
    worker thread) gives the answer with a :data:`SPLICE` for each large array, and each
    array's items, already JSON, in order. Built on the loop, or encoded in one call (which
    holds the GIL), 2,048 embeddings (16.6 MB) held every request 116-180 ms; twelve chat
    answers at once of n=8 x 900 tokens with 20 logprob alternatives (10.6 MB each) 130-161 ms.
    Spliced into one body, four such answers still cost the loop 9 ms each to hand to the
    socket, and their builders four copies each. Now the answer is copied once, into 1 MiB
    chunks, that the server writes as the client reads."""

    def made() -> list[bytes]:
        envelope, arrays = make()
        around = encode_json(envelope).split(b"\x00")  # at each SPLICE
        if len(around) != len(arrays) + 1:
            raise RuntimeError(f"answer has {len(around) - 1} places to splice, given {len(arrays)} arrays")
        chunks: list[bytes] = []
        pending: list[bytes] = [around[0]]
        size = len(around[0])
        for items, after in zip(arrays, around[1:], strict=True):
            for piece in (b"[", *_comma_separated(items), b"]", after):
                pending.append(piece)
                size += len(piece)
                if size >= _ANSWER_CHUNK:
                    chunks.append(b"".join(pending))
                    pending, size = [], 0
        chunks.append(b"".join(pending))
        return chunks

    chunks = await asyncio.get_running_loop().run_in_executor(_answer_maker, made)
    if len(chunks) == 1:
        return Response(chunks[0], media_type=MediaType.JSON)

    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    length = sum(map(len, chunks))
    return Stream(body(), media_type=MediaType.JSON, headers={"content-length": str(length)})


def _comma_separated(items: Sequence[bytes]) -> Iterator[bytes]:
    for i, item in enumerate(items):
        if i:
            yield b","
        yield item


def stream_response(chunks: AsyncIterator[bytes]) -> Stream:
    return Stream(chunks, media_type="text/event-stream", headers=_SSE_HEADERS)
