"""The front's side of a generation: a :class:`Prompt` ready to run, and the
:class:`GenerationStream` its caller reads (the request itself is the engine contract's,
:class:`~ortserve_runtime._contract.Request`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._contract import Engine, FinishReason, GenerationEvent, Request, Usage, hand_back
from .._errors import EngineClosedError, InvalidRequestError
from ._reasoning import ReasoningStart

if TYPE_CHECKING:
    from ._constraints import Constraint
    from ._reasoning import ReasoningBudget

__all__ = ["GenerationStream", "Prompt"]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt ready to run: its token ids and, for multimodal models, the processor's
    inputs (image and audio features; the ids then hold negative image placeholders)."""

    ids: Sequence[int]
    media: Any = None
    reasoning: ReasoningStart | None = None
    """For a reasoning model's chat: whether the output starts inside a think block
    (``open``), may open one (``opens``), or has none (``None``: thinking turned off)."""

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)


class GenerationStream:
    """Async iterator of :class:`GenerationEvent` for one request.

    The request reaches the engine on the first ``__anext__``. Leaving early (``break``,
    ``aclose()``, or cancelling the consuming task) cancels it in the engine and frees its
    batch row; :meth:`cancel` ends it with a final ``"cancelled"`` event instead.
    """

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine = engine
        self._request = request
        self._queue: asyncio.Queue[GenerationEvent | BaseException] = asyncio.Queue()
        self._started = False
        self._done = False
        self.prompt_tokens = len(request.prompt)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        if not self._started and self._request.cancelled:  # cancelled before it was read
            self._done = True
            self._drop()
            return self._request.final("cancelled")
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            queue = self._queue

            def deliver(item: GenerationEvent | BaseException) -> None:
                # The consumer's loop gone: nobody wants the rest.
                hand_back(loop, queue.put_nowait, item, lambda: self._engine.cancel(self._request))

            self._request.deliver = deliver
            self._request.submitted = time.perf_counter()
            self._engine.submit(self._request)
        try:
            item = await self._queue.get()
        except BaseException:
            self._abandon()
            raise
        if isinstance(item, BaseException):
            self._done = True
            self._drop()
            raise item
        if item.finish_reason is not None:
            self._done = True
            constraint = self._drop()
            if constraint is not None and constraint.error is not None:
                # The matcher gave up (a schema that compiles but cannot be followed, such as
                # an object that must hold itself): what came out does not match it.
                raise InvalidRequestError(
                    f"the output could not be made to follow the grammar: {constraint.error}", param="grammar"
                )
        return item

    def cancel(self) -> None:
        """Stop generating; the stream then ends with a ``"cancelled"`` event."""
        if not self._started:
            self._request.cancelled = True  # never submitted: the first read ends it
        elif not self._done:
            self._engine.cancel(self._request)

    async def aclose(self) -> None:
        """Stop consuming; the engine drops the request at its next step."""
        self._abandon()

    def _abandon(self) -> None:
        if self._started and not self._done:
            self._done = True
            self._engine.cancel(self._request)
        self._drop()

    def _drop(self) -> Constraint | ReasoningBudget | None:
        """Let go of the request's grammar matcher once the stream is over (returned, for a
        last look): an ended request's frames can stay in reference cycles until a full
        collection (a refused request's error and its tracebacks), and each refused pattern
        bomb kept its lexers there, 170 MiB a request. The engine reads it once a step. Its
        media too: the request and this stream hold each other (its ``deliver``), and the og
        process kept every ended request's processed images until a full collection (+73.5 MiB
        a request of eight 6-megapixel images, to 1,989 MiB: twenty-fifth probe, issue 45)."""
        constraint, self._request.constraint = self._request.constraint, None
        media, self._request.media = self._request.media, None
        give_back_room = getattr(media, "give_back_room", None)  # the og process's (RemoteMedia)
        if give_back_room is not None:
            give_back_room()  # as the engine would at the request's end, which now sees none
        return constraint

    async def collect(self) -> tuple[str, list[int], FinishReason, Usage]:
        """Run to the end and return text, token ids, finish reason and usage."""
        text: list[str] = []
        tokens: list[int] = []
        async for event in self:
            text.append(event.text)
            if event.token_id is not None:
                tokens.append(event.token_id)
            if event.finish_reason is not None:
                assert event.usage is not None
                return "".join(text), tokens, event.finish_reason, event.usage
        raise EngineClosedError("the generation ended without a final event")
