"""One request as the server records it (:class:`RequestRecord`): its id
(``x-request-id``), model, tokens, phases and span, kept in a context variable for the code
that serves it (the generation bridge notes the model and tokens, the plan times the
prompt's preparation, the tool loop its turns). ``_observe``'s middleware opens and closes
it; this module imports nothing of the server's, so any module may note into it.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ortserve_runtime import Usage

__all__ = [
    "CURRENT",
    "RECORD",
    "REQUEST_ID_HEADER",
    "RequestRecord",
    "current",
    "note",
    "record_prompt",
    "request_id_from",
    "request_id_of",
    "span",
    "traceparent",
]

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = REQUEST_ID_HEADER.encode()
_VALID_ID = re.compile(rb"[A-Za-z0-9._:@/+=-]{1,128}")
"""A client's own request id is kept when it is this: short, and nothing a log line or a
header could be broken by (else the server makes one)."""
RECORD = "ortserve.record"
"""Where the middleware leaves the :class:`RequestRecord` in the ASGI scope."""


CURRENT: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("ortserve_record", default=None)


@dataclass(slots=True, eq=False)
class RequestRecord:
    """One request as the log line, the usage per key and the trace see it."""

    id: str
    method: str
    path: str
    start: float = field(default_factory=time.perf_counter)
    """``time.perf_counter()`` when it arrived (the runtime's timings are on that clock)."""
    start_ns: int = field(default_factory=time.time_ns)
    route: str = ""
    """The route template that answered (``/v1/models/{model_id}``), once routed."""
    model: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    status: int = 0
    first_token: float | None = None
    """``perf_counter()`` of the first generated token, when there was one."""
    finish_reasons: list[str] = field(default_factory=list)
    response_id: str | None = None
    key: str | None = None
    """The label of the API key it came with (``None``: no key was needed or given)."""
    prompt: str | None = None
    """The prompt, for the log line only with ``log_prompts``."""
    trace: Any = None
    """The request's span while tracing (``_tracing.RequestSpan``), else ``None``."""
    counted: bool = True
    """Counted in the usage per key (API routes; not health and metrics)."""
    keep_prompt: bool = False
    """``ServerConfig.log_prompts``: :func:`record_prompt` keeps the prompt for the log line."""
    tool_loop: bool = False
    """The server runs the request's turns (MCP calls between them): each is a span."""
    turns: int = 0
    phases: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    """Seconds of queue wait, prefill and decode (the first choice's, summed over a tool
    loop's turns), as the runtime timed them: the log line's durations."""
    open_turns: list[Any] = field(default_factory=list)
    """Turn spans not ended yet (a turn that failed is ended with the request)."""

    def wall_ns(self, when: float) -> int:
        """``perf_counter()`` time ``when`` as nanoseconds since the epoch (span times)."""
        return self.start_ns + int((when - self.start) * 1e9)

    def generated(self, index: int, usage: Usage, model: str, turn: Any = None) -> None:
        """A stream (choice ``index``) of this request ended with ``usage``: its phases
        (queue wait, prefill, decode) become spans, as the runtime timed them, under the
        tool loop's ``turn`` where there is one (:meth:`open_turn`)."""
        if index == 0:
            self.phases[0] += usage.queued_seconds
            self.phases[1] += usage.prefill_seconds
            self.phases[2] += usage.decode_seconds
        if self.trace is not None:
            self.trace.phases(self, index, usage, model, time.perf_counter(), turn)

    def timed(self, name: str, since: float, attributes: Mapping[str, Any]) -> None:
        """A span ``name`` from ``since`` (``perf_counter()``) to now, once it is over (a
        speech sentence synthesized); nothing while tracing is off."""
        if self.trace is not None:
            self.trace.open(name, self, since, attributes).end(end_time=self.wall_ns(time.perf_counter()))

    def open_turn(self, model: str) -> Any:
        """A tool loop's turn starting now, as a span that :meth:`close_turn` ends; ``None``
        while tracing is off, or where the request runs no tool loop (one turn)."""
        if self.trace is None or not self.tool_loop:
            return None
        self.turns += 1
        attributes = {"gen_ai.request.model": model, "ortserve.turn": self.turns}
        turn = self.trace.open(f"turn {self.turns}", self, time.perf_counter(), attributes)
        self.open_turns.append(turn)
        return turn

    def close_turn(self, turn: Any) -> None:
        if turn is not None and turn in self.open_turns:
            self.open_turns.remove(turn)
            turn.end(end_time=self.wall_ns(time.perf_counter()))


def current() -> RequestRecord | None:
    """The record of the request being handled here, if any."""
    return CURRENT.get()


def note(
    *,
    model: str | None = None,
    input_tokens: int = 0,
    output_tokens: int = 0,
    cached_tokens: int = 0,
    finish_reasons: list[str] | None = None,
    response_id: str | None = None,
) -> None:
    """Add to the current request's record (tokens add up over a tool loop's turns)."""
    record = CURRENT.get()
    if record is None:
        return
    if model is not None:
        record.model = model
    record.input_tokens += input_tokens
    record.output_tokens += output_tokens
    record.cached_tokens += cached_tokens
    if finish_reasons:
        record.finish_reasons = finish_reasons
    if response_id is not None:
        record.response_id = response_id


def record_prompt(messages: Any) -> None:
    """Keep the prompt (a chat's last message, as text) for the log line, where the
    operator asked for prompts in logs (``log_prompts``); else nothing is kept."""
    record = CURRENT.get()
    if record is None or not record.keep_prompt:
        return
    last = messages[-1] if isinstance(messages, list) and messages else messages
    content = getattr(last, "content", last)
    if isinstance(content, list):
        content = " ".join(str(getattr(part, "text", "")) for part in content)
    record.prompt = content if isinstance(content, str) else None


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current request's span around a block (a tool loop's turn, an
    MCP call, the prompt's preparation); nothing at all while tracing is off."""
    record = CURRENT.get()
    if record is None or record.trace is None:
        return _NOTHING
    child: contextlib.AbstractContextManager[Any] = record.trace.child(name, attributes)
    return child


_NOTHING = contextlib.nullcontext()


def traceparent() -> str | None:
    """The W3C ``traceparent`` of the current request's span (work it starts for later, a
    batch's lines, continues it), or ``None`` while tracing is off."""
    record = CURRENT.get()
    return None if record is None or record.trace is None else record.trace.traceparent()


def request_id_of(scope: Any) -> str:
    """The request's id: its record's, else (an answer no route's middleware saw: a path no
    route matches) one made now and kept in the scope, for the body and the header alike."""
    record = scope.get(RECORD)
    if isinstance(record, RequestRecord):
        return record.id
    found = scope.get(_LONE_ID)
    if not isinstance(found, str):
        found = scope[_LONE_ID] = request_id_from(scope.get("headers", ()))
    return found


_LONE_ID = "ortserve.request_id"


def request_id_from(headers: Iterable[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == _REQUEST_ID:
            return value.decode() if _VALID_ID.fullmatch(value) else _new_request_id()
    return _new_request_id()


def _new_request_id() -> str:
    return "req_" + uuid.uuid4().hex
