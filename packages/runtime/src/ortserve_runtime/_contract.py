"""The engine contract: what the chat front and the engines share, so neither imports the other.

- :class:`Request`: one generation as the front hands it to an engine (prompt ids, options,
  sampler, stop matcher and grammar, the tokenizer to detokenize with) and what it has
  produced so far. An engine runs it and reports through ``request.deliver``; it either
  hands back logits (:meth:`Request.advance` samples on the host) or chooses tokens itself
  (:meth:`Request.take`). Either way stop strings, detokenization, length limits and usage
  are done here, the same on every engine.
- :class:`GenerationEvent`, :class:`Usage`, :data:`FinishReason`: what a request reports.
- :class:`Engine` and :class:`EngineCapabilities`: all that the front knows of an engine.
- The owner-thread bridge. onnxruntime-genai requires Engine calls from the thread that
  owns the engine, and a session run must never block the event loop; so each engine owns
  one thread (:class:`OwnerThread`), asyncio callers only append to its inbox
  (``submit``/``cancel``), and events go back through ``request.deliver`` (see
  :class:`~ortserve_runtime.chat.GenerationStream`), which calls :func:`hand_back`; speech
  and embeddings hand results back with :func:`resolve_future`.

  Each hand-back wakes the event loop through its self-pipe, and the owner thread then
  waits for the GIL while the loop runs (measured: about 2 ms a wake-up on 2 busy cores,
  against a 17 ms decode step). An engine that produces many events at once (a decode step
  of a batch) wraps them in :func:`batched_hand_backs`: one wake-up per loop for all of them.

The request's helpers (sampler, stop matcher, grammar, drafter, token names) are the
front's objects: this module calls their methods and names their types for the type
checker only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer, decoders

from ._errors import EngineClosedError

if TYPE_CHECKING:
    from ._drafts import Drafter
    from .chat._constraints import Constraint
    from .chat._logprobs import PromptLogprobs, TokenBytes, TokenLogprob
    from .chat._reasoning import ReasoningBudget
    from .chat._sampling import GenerationOptions, Sampler, Scored
    from .chat._stops import StopMatcher

__all__ = [
    "Deliver",
    "Engine",
    "EngineCapabilities",
    "FinishReason",
    "GenerationEvent",
    "OwnerThread",
    "Request",
    "Usage",
    "batched_hand_backs",
    "hand_back",
    "resolve_future",
]

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
    queued_seconds: float = field(default=0.0, compare=False)
    """From the submission to the engine taking the request up (its wait in the queue)."""
    prefill_seconds: float = field(default=0.0, compare=False)
    """From then to the first token (the prompt's prefill, past what the prefix cache held)."""
    decode_seconds: float = field(default=0.0, compare=False)
    """From the first token to the end. The three are what a server's trace shows of the
    request's phases; they do not take part in comparisons."""

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
    prompt_logprobs: PromptLogprobs | None = None
    """On a request's first event, its prompt's tokens scored, when the options asked for
    them (``prompt_logprobs``; engines whose capabilities say they can)."""


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
    constraint: Constraint | ReasoningBudget | None = None
    """The grammar matcher (or the reasoning budget around it) that masks logits on the
    host (engines that hand back logits)."""
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
    prompt_scores: list[Scored | None] | None = None
    """Per prompt token, its log-probabilities given the tokens before it, as the engine
    computes them (:meth:`score_prompt`); set (to ``None`` each) by the front when the
    options ask for ``prompt_logprobs``, handed over on the first event."""
    # Engine bookkeeping (ort_cpu: the cache row and how much of the prompt is in it).
    row: int = -1
    prefilled: int = 0
    # Timings (perf_counter), for Usage: submitted by the stream, taken up by the engine
    # (:meth:`admit`), first token taken.
    submitted: float = 0.0
    admitted: float = 0.0
    first_token: float = 0.0

    def admit(self) -> None:
        """The engine takes the request from its queue to prefill it (once; a request
        parked and taken up again keeps its first time)."""
        if not self.admitted:
            self.admitted = time.perf_counter()

    @property
    def length(self) -> int:
        """Tokens in this request's sequence (prompt plus generated)."""
        return len(self.prompt) + len(self.tokens)

    def advance(self, logits: npt.NDArray[np.float32]) -> GenerationEvent:
        """Sample the next token from ``logits`` on the host, then :meth:`take` it."""
        sampler = self.sampler
        options = sampler.options
        constraint = self.constraint  # once: its stream may drop it meanwhile (GenerationStream._drop)
        if sampler.argmax_unless_eos and constraint is None:
            # The sampler's greedy pick without its float64 copy: the first maximum of the
            # row stays the first maximum once EOS is masked, unless it is an EOS the
            # request may not end with yet (then the sampler masks and picks again).
            token = int(np.argmax(logits))
            if token not in self.eos or len(self.tokens) >= options.min_tokens:
                return self.take(token)
        history = [t for t in self.prompt if t >= 0] + self.tokens if sampler.options.repetition_penalty != 1.0 else []
        if constraint is not None:
            logits = constraint.mask(logits)
        token = sampler.choose(logits, history, len(self.tokens), self.tokens)
        if self.token_bytes is None:
            return self.take(token)
        return self.take(token, self.token_bytes.named(sampler.scored(token), self.decoded_chars))

    def score_prompt(self, start: int, logits: npt.NDArray[np.float32]) -> None:
        """Score the prompt tokens that ``logits`` predicts, if the options asked for it:
        row ``i`` holds the logits of prompt position ``start + i``, which give the
        distribution of the prompt's token ``start + i + 1`` (for engines that compute
        every position of a prefill call; the last position's logits score the output)."""
        scores = self.prompt_scores
        if scores is None:
            return
        prompt = self.prompt
        for i in range(min(len(logits), len(prompt) - 1 - start)):
            scores[start + i + 1] = self.sampler.prompt_scored(logits[i], prompt[start + i + 1])

    def _first_event(self, event: GenerationEvent) -> GenerationEvent:
        """``event`` with the prompt's scores, on the first event after they were all made."""
        scores = self.prompt_scores
        if scores is None or self.token_bytes is None or any(s is None for s in scores[1:]):
            return event  # not asked for, or not (yet) computed: a request cancelled before
        self.prompt_scores = None
        return replace(event, prompt_logprobs=self.token_bytes.prompt(self.prompt, scores))

    def take(self, token: int, logprobs: TokenLogprob | None = None) -> GenerationEvent:
        """Record ``token`` as the next one; the event says whether the request is done."""
        event = self._take(token, logprobs)
        return self._first_event(event) if self.prompt_scores is not None else event

    def _take(self, token: int, logprobs: TokenLogprob | None) -> GenerationEvent:
        if not self.tokens:
            self.first_token = time.perf_counter()
        self.tokens.append(token)
        constraint = self.constraint
        complete = constraint is not None and constraint.advance(token)
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
        event = GenerationEvent(
            token_id=token,
            text=text,
            finish_reason=reason,
            usage=self.usage(),
            logprobs=logprobs,
            stop_sequence=self.stops.matched,
        )
        return self._first_event(event) if self.prompt_scores is not None else event

    def usage(self) -> Usage:
        """The token counts so far (a final event carries them)."""
        drafter = self.drafter
        accepted = drafter.accepted if drafter is not None else 0
        rejected = drafter.proposed - accepted if drafter is not None else 0
        now = time.perf_counter()
        submitted = self.submitted or now
        admitted = self.admitted or submitted  # an engine that does not say: no wait counted
        first = self.first_token or now
        return Usage(
            len(self.prompt),
            len(self.tokens),
            self.cached_tokens,
            accepted,
            rejected,
            queued_seconds=max(0.0, admitted - submitted),
            prefill_seconds=max(0.0, first - admitted),
            decode_seconds=max(0.0, now - first),
        )

    def _tail(self) -> str:
        """Text the streaming decoder still holds (an unfinished UTF-8 sequence at the end),
        rendered the way a full decode renders it."""
        tokens = [t for t in self.tokens if t not in self.eos]
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))[self.decoded_chars :]


@dataclass(frozen=True, slots=True)
class EngineCapabilities:
    """What an engine does, so the front validates and prepares requests to match."""

    host_sampling: bool
    """Logits come back to the host: sampling, grammar masks and per-request seeds run
    in NumPy (else the engine samples and takes the grammar itself)."""
    seeds: bool
    """Per-request seeds are honoured."""
    media: bool
    """Takes a multimodal processor's inputs (images, audio)."""
    batching: Literal["continuous", "dynamic", "static", "interleaved"]
    """continuous: a request joins/leaves the batch at any step (ort-cpu); dynamic:
    og.Engine with paged attention; static: og.Engine batches that newcomers wait for;
    interleaved: one og.Generator per request, stepped in turn."""
    reproducible: bool
    """A request's tokens (and logprobs) are a function of the request alone: the same on a
    repeat, whatever the engine's caches hold and whoever shares its steps (greedy, or
    sampled with a seed). ort-cpu promises it unless it prefills in int8 (activations
    scaled per call); og-generator runs each request alone; og-engine's static batches
    were measured to keep greedy tokens, while its dynamic batches (paged attention, an
    accelerator's kernels over whatever the step holds) make no such promise."""
    drafts: bool = False
    """Takes a request's draft tokens (its ``prediction``) and checks them in one call:
    ort-cpu. og.Engine on the CPU reports ``max_draft_tokens_per_proposal() == 0`` and
    refuses ``Request.set_draft_tokens`` ("This engine does not support speculative draft
    verification", og 0.18); og.Generator takes no drafts from its caller."""
    salted_cache: bool = True
    """A request's ``cache_salt`` keeps other requests from reusing its key/values: ort-cpu
    scopes its prefix cache by it, og-generator shares nothing between requests; og-engine
    with paged attention reuses prefixes inside onnxruntime-genai, which takes no salt."""
    prompt_logprobs: bool = False
    """Scores a request's prompt (``GenerationOptions.prompt_logprobs``, and ``max_tokens``
    0): ort-cpu computes every prompt position's logits for it. og.Engine hands back no
    logits; og.Generator's ``get_output("logits")`` holds every position after
    ``append_tokens`` (og 0.18), but they live in og's process and are not fetched yet."""


@runtime_checkable
class Engine(Protocol):
    """Runs :class:`Request` objects; all that the front and the streams know of an engine."""

    name: str
    """``ort-cpu``, ``og-engine`` or ``og-generator``."""
    provider: str
    capabilities: EngineCapabilities

    def submit(self, request: Request) -> None:
        """Queue ``request``; its events arrive through ``request.deliver``. Any thread."""

    def cancel(self, request: Request) -> None:
        """End ``request`` with a ``"cancelled"`` event at the engine's next step. Any thread."""

    @property
    def closing(self) -> bool:
        """Whether :meth:`close` was called (new requests are refused)."""

    async def close(self) -> None:
        """Stop: pending requests get :class:`EngineClosedError`; the thread exits."""

    @property
    def active(self) -> int:
        """Requests being generated now."""

    @property
    def queued(self) -> int:
        """Requests waiting to start."""


_HandBack = tuple[Callable[[Any], None], object, Callable[[], None]]
"""A callback, its argument, and what to do instead when the loop is gone."""
_batch = threading.local()
"""``pending``: while :func:`batched_hand_backs` runs on a thread, the hand-backs it collects."""


def hand_back(
    loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], item: object, on_gone: Callable[[], None]
) -> None:
    """Call ``callback(item)`` on ``loop`` from any thread (later, within
    :func:`batched_hand_backs`); ``on_gone()`` instead, on this thread, if the loop is gone."""
    pending: dict[asyncio.AbstractEventLoop, list[_HandBack]] | None = getattr(_batch, "pending", None)
    if pending is not None:
        pending.setdefault(loop, []).append((callback, item, on_gone))
        return
    try:
        loop.call_soon_threadsafe(callback, item)
    except RuntimeError:
        on_gone()


@contextlib.contextmanager
def batched_hand_backs() -> Iterator[None]:
    """Collect the :func:`hand_back` calls of this thread and make them on leaving, one
    wake-up per event loop."""
    _batch.pending = {}
    try:
        yield
    finally:
        pending, _batch.pending = _batch.pending, None
        for loop, calls in pending.items():
            try:
                loop.call_soon_threadsafe(_call_each, calls)
            except RuntimeError:
                for _, _, on_gone in calls:
                    on_gone()


def _call_each(calls: list[_HandBack]) -> None:
    for callback, item, _ in calls:
        callback(item)


def resolve_future(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], result: object) -> None:
    """Set ``future`` (an exception if ``result`` is one) on its own loop, from any thread.

    A future that is already done (its caller was cancelled) or whose loop is gone is
    left alone: nobody is waiting for it any more.
    """

    def apply() -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(apply)


class OwnerThread:
    """The owner-thread bridge: an inbox, cancellations and closing, guarded by one
    condition; subclasses implement :meth:`_run` (started by :meth:`_start_thread`)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._closing = False
        self._cond = threading.Condition()
        self._inbox: deque[Request] = deque()
        self._cancels: set[Request] = set()
        self._thread = threading.Thread(target=self._run, name=f"ortserve-{model_name}", daemon=True)

    def _start_thread(self) -> None:
        self._thread.start()

    @property
    def closing(self) -> bool:
        return self._closing

    @property
    def queued(self) -> int:
        return len(self._inbox)

    @property
    def active(self) -> int:
        raise NotImplementedError

    def submit(self, request: Request) -> None:
        with self._cond:
            if self._closing:
                request.deliver(EngineClosedError(f"model {self.model_name!r} is closed"))
                return
            if request.options.background or not self._inbox or not self._inbox[-1].options.background:
                self._inbox.append(request)
            else:  # an interactive request goes before the background ones
                first = next(i for i, queued in enumerate(self._inbox) if queued.options.background)
                self._inbox.insert(first, request)
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        with self._cond:
            request.cancelled = True
            self._cancels.add(request)
            self._cond.notify()

    async def close(self) -> None:
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """:meth:`close` for synchronous callers (a load that fails after the engine started)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _closed_error(self) -> EngineClosedError:
        return EngineClosedError(f"model {self.model_name!r} was closed")

    def _run(self) -> None:
        raise NotImplementedError
