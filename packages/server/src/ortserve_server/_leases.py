"""Which model a request uses, and its hold on it until the response is over, streams included.

A route takes a model with :func:`require_model` (and its siblings per kind): the name
checked (404, or a 400 naming the right route for another kind), the keep-alive parsed,
the queue's room checked, the model loaded and held by :func:`hold_model`.
:func:`release_leases` (ASGI middleware on our routers) lets go of it once the response
has been sent, the last SSE event of a stream included, or the request failed. While a model is held, an unload waits for it
(up to its grace period) and eviction passes it by.
"""

from __future__ import annotations

import contextvars
import hmac
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send
from ortserve_runtime import (
    AdapterNotFoundError,
    ChatModel,
    EmbeddingModel,
    ModelKind,
    ModelLease,
    ModelRegistry,
    RerankModel,
    SpeechModel,
    VoiceModel,
)

from ._errors import BadRequestError, ForbiddenError, ModelNotFoundHTTPError, OverloadedError
from ._record import note
from ._state import OrtServe

__all__ = [
    "hold_model",
    "keep_alive_by_admin",
    "mark_admin_callers",
    "model_adapters",
    "parse_keep_alive",
    "presents_key",
    "release_leases",
    "require_embedding_model",
    "require_model",
    "require_rerank_model",
    "require_speech_model",
    "require_voice_model",
    "split_adapter",
]

KeepAlive = float | str | msgspec.UnsetType | None

_held: contextvars.ContextVar[list[ModelLease] | None] = contextvars.ContextVar("ortserve_leases", default=None)


async def hold_model(registry: ModelRegistry, name: str, keep_alive: float | None = None) -> object:
    """The model ``name``, loaded if need be, held until the current response is over;
    then it stays loaded ``keep_alive`` seconds once idle (``None``: the server default)."""
    lease = await registry.acquire(name)
    lease.keep_alive = keep_alive
    held = _held.get()
    if held is None:  # outside our routers (no middleware to let go later): no hold
        lease.release()
    else:
        held.append(lease)
    return lease.model


_admin: contextvars.ContextVar[bool] = contextvars.ContextVar("ortserve_admin_caller", default=False)


def mark_admin_callers(admin_key: str) -> Callable[[ASGIApp], ASGIApp]:
    """Middleware factory: remember whether a request presents the admin key
    (``Authorization: Bearer`` or ``x-api-key``), for :func:`keep_alive_by_admin`."""

    def factory(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            token = _admin.set(presents_key(scope.get("headers", []), admin_key))
            try:
                await app(scope, receive, send)
            finally:
                _admin.reset(token)

        return middleware

    return factory


def presents_key(headers: Iterable[tuple[bytes, bytes]], key: str) -> bool:
    """Whether ASGI ``headers`` carry ``key`` (``Authorization: Bearer`` or ``x-api-key``)."""
    named = dict(headers)
    bearer = named.get(b"authorization", b"").partition(b" ")
    given = [named.get(b"x-api-key", b"").strip()]
    if bearer[0].lower() == b"bearer":
        given.append(bearer[2].strip())
    return any(hmac.compare_digest(value, key.encode()) for value in given if value)


MIN_KEEP_ALIVE = 60.0
"""The shortest ``keep_alive`` an API caller may give where an admin key is set (unless the
server's own ``idle_unload`` is shorter): ``keep_alive: 0.001`` let any key unload a model
after each of its requests, so that every other key's next request waited for its load
(0.2-1.4 s on the thirteenth probe's server, whose /health that load held 110-200 ms)."""


MAX_KEEP_ALIVE = 24 * 3600.0
"""The longest ``keep_alive`` an API caller may give where an admin key is set and idle models
unload (unless the server's own ``idle_unload`` is longer): ``keep_alive: "867000h"`` (98
years, just short of the 100 that count as for ever) let any key pin a model past
``--idle-unload``, as only the admin key may."""


def keep_alive_by_admin(seconds: float | None, admin_key: str | None, idle_unload: float | None = None) -> None:
    """Refuse (403 naming ``keep_alive``) a request's ``keep_alive`` of 0 (unload now),
    negative (keep loaded for ever; :func:`parse_keep_alive` makes one past 100 years so),
    shorter than :data:`MIN_KEEP_ALIVE` (or ``idle_unload``, if shorter) or longer than
    :data:`MAX_KEEP_ALIVE` (or ``idle_unload``, if longer) unless it comes with the admin key,
    where one is set: unloading and pinning models are the control routes' to do, not any API
    caller's."""
    if admin_key is None or seconds is None or _admin.get():
        return
    shortest = MIN_KEEP_ALIVE if idle_unload is None else min(MIN_KEEP_ALIVE, idle_unload)
    longest = None if idle_unload is None else max(MAX_KEEP_ALIVE, idle_unload)  # None: the server keeps for ever
    if seconds > 0 and longest is not None and seconds > longest:
        raise ForbiddenError(
            f"keep_alive longer than {longest:g} seconds needs the admin key on this server, whose idle models "
            f"unload after {idle_unload:g} seconds: give a shorter duration, send the admin key, or use the control "
            "routes (/v1/models/load)",
            param="keep_alive",
        )
    if seconds >= shortest:
        return
    if seconds > 0:
        raise ForbiddenError(
            f"keep_alive shorter than {shortest:g} seconds needs the admin key on this server: each unload makes "
            "the next request of every key load the model again; give a longer duration, or send the admin key",
            param="keep_alive",
        )
    raise ForbiddenError(
        "keep_alive 0 (unload), or negative or past 100 years (keep loaded), needs the admin key on this server: "
        "send it (Authorization: Bearer <admin key>), use the control routes (/v1/models/load, /v1/models/unload), "
        "or give a positive duration",
        param="keep_alive",
    )


def release_leases(app: ASGIApp) -> ASGIApp:
    """Middleware: release the models a request held once its response is over."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        held: list[ModelLease] = []
        token = _held.set(held)
        try:
            await app(scope, receive, send)
        finally:
            _held.reset(token)
            for lease in held:
                lease.release()
            # Tasks and timers started by the request copied the context, this list in it:
            # left full, a timer kept the leases, so the model, alive after its unload.
            held.clear()

    return middleware


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h)")
_NUMBER = re.compile(r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_FOREVER = 100 * 365 * 86400.0
"""Longer than this is as good as forever (and keeps expiry times finite)."""


def parse_keep_alive(value: float | str | msgspec.UnsetType | None) -> float | None:
    """``keep_alive`` as seconds (Ollama's forms: a number of seconds, or a duration such
    as ``"90s"``, ``"5m"``, ``"1h30m"``; negative keeps the model loaded), ``None`` when
    absent; a 400 naming the field otherwise."""
    if value is None or isinstance(value, msgspec.UnsetType):
        return None
    if isinstance(value, bool):
        raise _bad_keep_alive(value)
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _DURATION.findall(body)
        if body and "".join(number + unit for number, unit in parts) == body:
            seconds = sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
        elif _NUMBER.fullmatch(body):
            seconds = sign * float(body)
        else:
            raise _bad_keep_alive(value)
    if math.isnan(seconds):
        raise _bad_keep_alive(value)
    return -1.0 if seconds > _FOREVER else seconds


def _bad_keep_alive(value: object) -> BadRequestError:
    return BadRequestError(
        f"keep_alive must be seconds or a duration such as '90s', '5m' or '1h' (negative: keep loaded), got {value!r}",
        param="keep_alive",
    )


def split_adapter(state: OrtServe, model_id: str) -> tuple[str, str | None]:
    """A model id as (model name, LoRA adapter name or ``None``): ``MODEL:ADAPTER`` names an
    adapter of a served model, the way vLLM and llama-server list theirs, unless the whole
    id is itself a model's name."""
    names = state.registry.names()
    base, sep, adapter = model_id.rpartition(":")
    if model_id in names or not sep or base not in names:
        return model_id, None
    return base, adapter


def model_adapters(state: OrtServe, name: str) -> tuple[str, ...]:
    """The LoRA adapters model ``name`` serves (before it loads too; those added over HTTP included)."""
    return state.registry.adapters(name)


async def require_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> ChatModel:
    """The loaded generative model called ``name`` (``MODEL:ADAPTER``: through that LoRA
    adapter), or a 404/400/503 that says why not; held for this request (see ``_leases``),
    then kept loaded ``keep_alive``."""
    base, adapter = split_adapter(state, name)
    if adapter is not None and adapter not in model_adapters(state, base):
        raise AdapterNotFoundError(base, adapter, model_adapters(state, base))
    loaded: ChatModel = await _loaded(state, base, "generative", keep_alive)
    model = loaded.with_adapter(adapter)
    if model.queued >= state.config.max_queued:
        raise OverloadedError(
            f"model {name!r} has {model.queued} requests waiting; try again shortly", headers={"Retry-After": "1"}
        )
    return model


async def require_embedding_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> EmbeddingModel:
    """The loaded embedding model called ``name``, or a 404/400 that says why not."""
    model: EmbeddingModel = await _loaded(state, name, "embedding", keep_alive)
    return model


async def require_rerank_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> RerankModel:
    """The loaded rerank (cross-encoder) model called ``name``, or a 404/400 that says why not."""
    model: RerankModel = await _loaded(state, name, "rerank", keep_alive)
    return model


async def require_speech_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> SpeechModel:
    """The loaded speech-to-text model called ``name``, or a 404/400/503 that says why not."""
    model: SpeechModel = await _loaded(state, name, "speech", keep_alive)
    # A speech model takes in every request at once and serves them by turns, so all it
    # holds count against the limit, not only those not taken in yet.
    held = model.queued + model.active
    if held >= state.config.max_queued:
        raise OverloadedError(f"model {name!r} has {held} requests waiting", headers={"Retry-After": "1"})
    return model


async def require_voice_model(state: OrtServe, name: str, keep_alive: KeepAlive = msgspec.UNSET) -> VoiceModel:
    """The loaded voice (text-to-speech) model called ``name``, or a 404/400 that says why not."""
    model: VoiceModel = await _loaded(state, name, "voice", keep_alive)
    return model


async def _loaded(state: OrtServe, name: str, kind: ModelKind, keep_alive: KeepAlive = msgspec.UNSET) -> Any:
    seconds = parse_keep_alive(keep_alive)
    keep_alive_by_admin(seconds, state.config.admin_key, state.config.idle_unload)
    registry = state.registry
    if name not in registry.names():
        raise ModelNotFoundHTTPError(f"model {name!r} does not exist", param="model")
    note(model=name)  # a served name only: usage and logs never take a label a client made up
    actual = registry.kind(name)
    if actual != kind:
        use = {
            "generative": "/v1/chat/completions or /v1/completions",
            "embedding": "/v1/embeddings",
            "rerank": "/v1/rerank or /v1/score",
            "speech": "/v1/audio/transcriptions",
            "voice": "/v1/audio/speech",
        }[actual]
        raise BadRequestError(f"model {name!r} is a {actual} model; use {use}", param="model")
    return await hold_model(registry, name, seconds)
