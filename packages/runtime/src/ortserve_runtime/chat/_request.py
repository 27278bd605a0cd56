"""One generation as the front hands it to an engine, and the stream its caller reads.

The front (:class:`~.ChatModel`) builds a :class:`Request`: prompt ids, options, sampler,
stop matcher and grammar, the tokenizer to detokenize with. An engine runs it and reports
through ``request.deliver``; it either hands back logits (:meth:`Request.advance` samples
on the host) or chooses tokens itself (:meth:`Request.take`). Either way stop strings,
detokenization, length limits and usage are done here, the same on every engine.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer, decoders

from .._errors import EngineClosedError, InvalidRequestError
from .._threads import hand_back
from ._constraints import Constraint
from ._drafts import Drafter
from ._logprobs import TokenBytes, TokenLogprob
from ._reasoning import ReasoningStart
from ._sampling import GenerationOptions, Sampler
from ._stops import StopMatcher

if TYPE_CHECKING:
    from ..engines import Engine

__all__ = ["FinishReason", "GenerationEvent", "GenerationStream", "Prompt", "Request", "Usage"]

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one finished request."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens whose key/values came from the engine's prefix cache (not prefilled)."""
    accepted_prediction_tokens: int = 0
    """Draft tokens (speculative decoding: the request's prediction or a prompt lookup) that
    became output tokens; OpenAI's ``completion_tokens_details`` name."""
    rejected_prediction_tokens: int = 0
    """Draft tokens checked and not taken."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One step of a generation: a token and its text, or the end (``finish_reason`` set)."""

    token_id: int | None
    """The sampled token, or ``None`` on a final event that carries no token."""
    text: str
    """Newly decoded text that is safe to show (may be empty while text is held back)."""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    """Set on the final event only."""
    logprobs: TokenLogprob | None = None
    """The token's log-probability and alternatives, when the options asked for them (and
    the engine hands back logits); an end-of-sequence token has none (no event names it)."""
    stop_sequence: str | None = None
    """On the final event, the stop string that ended the generation (``None`` when it
    ended otherwise): Anthropic's API reports which one matched."""


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


_request_ids = itertools.count(1)
Deliver = Callable[[GenerationEvent | BaseException], None]
"""Hands an event (or the error that ends the request) to its consumer; thread-safe."""


def _nobody(item: GenerationEvent | BaseException) -> None:
    """``deliver`` before the stream has a consumer (replaced on submission)."""


@dataclass(eq=False)
class Request:
    """Everything an engine needs of one generation, and what it has produced so far."""

    prompt: list[int]
    max_tokens: int
    options: GenerationOptions
    sampler: Sampler
    stops: StopMatcher
    tokenizer: Tokenizer
    eos: frozenset[int]
    deliver: Deliver = _nobody
    constraint: Constraint | None = None
    """The grammar matcher that masks logits on the host (engines that hand back logits)."""
    media: Any = None
    """The processor's inputs for a multimodal prompt (see :class:`Prompt`)."""
    token_bytes: TokenBytes | None = None
    """Names the tokens of log-probabilities; set only when the options ask for them."""
    adapter: str | None = None
    """The LoRA adapter to generate through (a name the engine loaded), or the base model."""
    drafter: Drafter | None = None
    """Proposes draft tokens for speculative decoding (engines that take drafts), if the
    request has a prediction or its model speculates."""
    id: int = field(default_factory=lambda: next(_request_ids))
    tokens: list[int] = field(default_factory=list)
    decoder: Any = field(default_factory=lambda: decoders.DecodeStream(skip_special_tokens=True))
    cancelled: bool = False
    decoded_chars: int = 0
    """Characters the streaming decoder produced so far."""
    cached_tokens: int = 0
    """Prompt tokens the engine took from its prefix cache."""
    # Engine bookkeeping (ort_cpu: the cache row and how much of the prompt is in it).
    row: int = -1
    prefilled: int = 0

    @property
    def length(self) -> int:
        """Tokens in this request's sequence (prompt plus generated)."""
        return len(self.prompt) + len(self.tokens)

    def advance(self, logits: npt.NDArray[np.float32]) -> GenerationEvent:
        """Sample the next token from ``logits`` on the host, then :meth:`take` it."""
        sampler = self.sampler
        options = sampler.options
        if sampler.argmax_unless_eos and self.constraint is None:
            # The sampler's greedy pick without its float64 copy: the first maximum of the
            # row stays the first maximum once EOS is masked, unless it is an EOS the
            # request may not end with yet (then the sampler masks and picks again).
            token = int(np.argmax(logits))
            if token not in self.eos or len(self.tokens) >= options.min_tokens:
                return self.take(token)
        history = [t for t in self.prompt if t >= 0] + self.tokens if sampler.options.repetition_penalty != 1.0 else []
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = sampler.choose(logits, history, len(self.tokens), self.tokens)
        if self.token_bytes is None:
            return self.take(token)
        return self.take(token, self.token_bytes.named(sampler.scored(token), self.decoded_chars))

    def take(self, token: int, logprobs: TokenLogprob | None = None) -> GenerationEvent:
        """Record ``token`` as the next one; the event says whether the request is done."""
        self.tokens.append(token)
        complete = self.constraint is not None and self.constraint.advance(token)
        if token in self.eos:  # the end is no output token: its logprob is not reported
            return self.final("stop", self.stops.feed(self._tail())[0] + self.stops.flush())
        piece = self.decoder.step(self.tokenizer, token) or ""
        self.decoded_chars += len(piece)
        if complete or len(self.tokens) >= self.max_tokens:
            piece += self._tail()
        text, stopped = self.stops.feed(piece)
        if stopped:
            return self.final("stop", text, token, logprobs)
        if complete:
            return self.final("stop", text + self.stops.flush(), token, logprobs)
        if len(self.tokens) >= self.max_tokens:
            return self.final("length", text + self.stops.flush(), token, logprobs)
        return GenerationEvent(token_id=token, text=text, logprobs=logprobs)

    def final(
        self, reason: FinishReason, text: str = "", token: int | None = None, logprobs: TokenLogprob | None = None
    ) -> GenerationEvent:
        return GenerationEvent(
            token_id=token,
            text=text,
            finish_reason=reason,
            usage=self.usage(),
            logprobs=logprobs,
            stop_sequence=self.stops.matched,
        )

    def usage(self) -> Usage:
        """The token counts so far (a final event carries them)."""
        drafter = self.drafter
        accepted = drafter.accepted if drafter is not None else 0
        rejected = drafter.proposed - accepted if drafter is not None else 0
        return Usage(len(self.prompt), len(self.tokens), self.cached_tokens, accepted, rejected)

    def _tail(self) -> str:
        """Text the streaming decoder still holds (an unfinished UTF-8 sequence at the end),
        rendered the way a full decode renders it."""
        tokens = [t for t in self.tokens if t not in self.eos]
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))[self.decoded_chars :]


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
            return self._request.final("cancelled")
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            queue = self._queue

            def deliver(item: GenerationEvent | BaseException) -> None:
                # The consumer's loop gone: nobody wants the rest.
                hand_back(loop, queue.put_nowait, item, lambda: self._engine.cancel(self._request))

            self._request.deliver = deliver
            self._engine.submit(self._request)
        try:
            item = await self._queue.get()
        except BaseException:
            self._abandon()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
            constraint = self._request.constraint
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
