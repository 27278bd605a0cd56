"""Scale-out on Ray Serve: N replicas of ortserve behind one HTTP ingress, routed by prefix.

Needs the ``ray`` extra (``pip install "ortserve-server[ray]"``); the rest of the server
does not import this module, so it runs without Ray.

Two deployments make one Ray Serve application:

- ``OrtServeIngress`` receives HTTP from Ray's proxy, reads the body, derives the
  request's affinity key (the conversation's opening, see :func:`affinity_key`) and
  forwards the request to a replica through a deployment handle. Ray's proxy hands an
  ASGI ingress only the request's scope, never its body, so a router that looks at the
  prompt has to sit behind a hop that has read it (Ray Serve LLM's OpenAI ingress does
  the same).
- ``OrtServeReplica`` (``replicas`` of them) runs ortserve's own ASGI app
  (:func:`~ortserve_server.create_app`) with its lifespan entered, so each replica loads
  the models once and keeps its own prefix cache. ``/health`` is Ray's health check; on
  downscale Ray stops sending it requests, waits for those under way (up to
  ``graceful_shutdown_timeout_s``), then the lifespan closes the models.

:class:`PrefixAffinityRouter` sends requests with the same affinity key to the same
replica (rendezvous hashing, so a replica joining or leaving moves only its own share),
unless that replica's queue is ``max_imbalance`` longer than the shortest; then, and for
requests without a key, it routes as Ray's default power-of-two-choices router does.

Every response carries ``x-ortserve-replica`` (the replica's id); ``/metrics`` on the
ingress gathers every replica's metrics with a ``replica`` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, cast

try:
    import ray
    from ray import serve
    from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'ortserve_server.ray needs Ray Serve: install the "ray" extra (pip install "ortserve-server[ray]")'
    ) from exc

from ._app import create_app, lifespan
from ._config import ServerConfig, parse_mcp_server
from ._ray_routing import affinity_key, merge_metrics, response_owner

try:
    from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import (
        LocalityMixin,
        MultiplexMixin,
        PendingRequest,
        RequestRouter,
        RunningReplica,
    )

    _HAS_CUSTOM_ROUTERS = True
except ImportError:  # pragma: no cover - a Ray without pluggable request routers
    _HAS_CUSTOM_ROUTERS = False

__all__ = [
    "REPLICA_HEADER",
    "PrefixAffinityRouter",
    "RayOptions",
    "affinity_key",
    "app_builder",
    "build_app",
    "response_owner",
]

logger = logging.getLogger("ortserve.ray")

REPLICA_HEADER = "x-ortserve-replica"
"""The response header naming the replica that served the request."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(slots=True)
class RayOptions:
    """How the application runs on Ray (the models and limits are the ``ServerConfig``)."""

    replicas: int = 2
    """Replicas of ortserve, each loading every model."""
    replica_cpus: float = 1.0
    """CPUs Ray reserves per replica (a scheduling figure; give onnxruntime a matching
    ``intra_op_threads`` in the model config)."""
    replica_gpus: float = 0.0
    """GPUs Ray reserves per replica (for the cuda provider)."""
    ingress_cpus: float = 0.1
    """CPUs Ray reserves for the ingress (it only reads bodies and forwards)."""
    router: Literal["prefix", "default"] = "prefix"
    """``prefix``: :class:`PrefixAffinityRouter`; ``default``: Ray's power of two choices."""
    prefix_chars: int = 1024
    """Characters of the conversation's opening that make the affinity key."""
    max_imbalance: int = 4
    """Queue length by which the preferred replica may exceed the shortest before a
    request goes elsewhere."""
    max_ongoing_requests: int = 64
    """Requests one replica takes at once (ortserve queues beyond its batch itself)."""
    health_check_period_s: float = 10.0
    """How often Ray calls the replica's ``/health``; a failure replaces the replica."""
    health_check_timeout_s: float = 30.0
    """How long that call may take."""
    graceful_shutdown_timeout_s: float = 60.0
    """How long a replica being removed may finish the requests under way."""
    deployment_options: dict[str, Any] = field(default_factory=dict)
    """Further ``@serve.deployment`` options for the replicas (``autoscaling_config``...)."""


# --- the request the ingress forwards ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Forwarded:
    """An HTTP request the ingress has read, as it travels to a replica."""

    scope: dict[str, Any]
    """The ASGI scope's plain fields (method, path, headers...)."""
    body: bytes
    affinity: str | None = None
    """:func:`affinity_key`, read by :class:`PrefixAffinityRouter`."""
    replica: str | None = None
    """A replica id this request must go to (the ingress gathering metrics)."""
    owner: str | None = None
    """The replica holding the stored response this request names (see :func:`response_owner`):
    it goes there while that replica is routable, else where the router sends it (the
    response is then gone, and the replica answers so)."""


_SCOPE_FIELDS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string", "headers")


def _plain_scope(scope: Scope) -> dict[str, Any]:
    plain = {key: scope[key] for key in _SCOPE_FIELDS if key in scope}
    plain["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    for key in ("client", "server"):
        if scope.get(key) is not None:
            plain[key] = tuple(scope[key])
    plain["root_path"] = ""
    return plain


# --- the router ------------------------------------------------------------------------

if _HAS_CUSTOM_ROUTERS:

    class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):  # type: ignore[misc,unused-ignore]
        """Sends requests with the same affinity key to the same replica while load
        stays balanced.

        The preferred replica is the one whose hash with the key is highest (rendezvous
        hashing). It is tried alone first, up to ``affinity_tries`` routing attempts
        (Ray's queue-length probe waits longer each time), unless it is full or its known
        queue is ``max_imbalance`` longer than the shortest known one; then the request
        goes to the better of two random replicas, as with Ray's default router.
        Not FIFO across requests on purpose: each routing decision serves the request it
        was made for.
        """

        def initialize_state(self, max_imbalance: int = 4, affinity_tries: int = 4, **unknown: Any) -> None:
            if unknown:  # Ray's signature takes any keyword; ours takes only these
                raise TypeError(f"PrefixAffinityRouter has no options {', '.join(sorted(unknown))}")
            self._max_imbalance = max_imbalance
            self._affinity_tries = affinity_tries
            self._tries: dict[str, int] = {}
            """Routing attempts per request that the preferred replica did not take."""

        async def choose_replicas(
            self,
            candidate_replicas: list[RunningReplica],
            pending_request: PendingRequest | None = None,
        ) -> list[list[RunningReplica]]:
            forwarded = _forwarded(pending_request)
            if forwarded is not None and forwarded.replica is not None:
                return [[r for r in candidate_replicas if r.replica_id.unique_id == forwarded.replica]]
            if forwarded is not None and forwarded.owner is not None:
                owner = [r for r in candidate_replicas if r.replica_id.unique_id == forwarded.owner]
                if owner:
                    return [owner]
            fallback: list[list[RunningReplica]] = await PowerOfTwoChoicesRequestRouter.choose_replicas(
                self,  # type: ignore[arg-type,unused-ignore]  # the same mixins, without FIFO matching
                candidate_replicas,
                pending_request,
            )
            if (
                pending_request is None
                or forwarded is None
                or forwarded.affinity is None
                or len(candidate_replicas) < 2
            ):
                return fallback
            preferred = max(candidate_replicas, key=lambda r: _rendezvous(forwarded.affinity, r))
            queued = self._queue_len(preferred)
            if (
                queued >= preferred.max_ongoing_requests
                or queued - min(map(self._queue_len, candidate_replicas)) > self._max_imbalance
            ):
                return fallback
            # A replica that is merely slow to answer Ray's queue-length probe (a busy CPU)
            # is tried alone a few times, each probe waiting longer, before the others.
            request_id = pending_request.metadata.internal_request_id
            tries = self._tries.pop(request_id, 0) + 1
            if tries < self._affinity_tries:
                if len(self._tries) > 10_000:  # requests cancelled before they were routed
                    self._tries.clear()
                self._tries[request_id] = tries
                return [[preferred]]
            return [[preferred], *fallback]

        def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
            self._tries.pop(pending_request.metadata.internal_request_id, None)

        def _queue_len(self, replica: RunningReplica) -> int:
            # The cache Ray fills from its probes and sends; unknown counts as empty (the
            # probe that follows refuses a full replica anyway).
            known = self._replica_queue_len_cache.get(replica.replica_id)
            return int(known) if known is not None else 0

else:  # pragma: no cover - a Ray without pluggable request routers
    PrefixAffinityRouter = None  # type: ignore[assignment,misc]


def _forwarded(pending_request: Any) -> _Forwarded | None:
    # By class name, not isinstance: Ray may load the router class apart from this module
    # (from its pickled form), with a _Forwarded class of its own.
    args = getattr(pending_request, "args", None) or ()
    return next((arg for arg in args if type(arg).__qualname__ == _Forwarded.__qualname__), None)


def _rendezvous(key: str | None, replica: Any) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica.replica_id.unique_id}".encode(), digest_size=8).digest()


# --- a replica ---------------------------------------------------------------------------


class OrtServeReplica:
    """One ortserve: its app, lifespan entered, answering forwarded requests."""

    async def __init__(self, config: ServerConfig) -> None:  # type: ignore[misc]  # Ray awaits it
        self._id = serve.get_replica_context().replica_id.unique_id
        config = replace(config, response_id_tag=self._id)  # see response_owner
        self._config = config
        self._app = create_app(config)
        self._lifespan = lifespan(self._app)
        await self._lifespan.__aenter__()

    async def __call__(self, request: _Forwarded) -> AsyncIterator[Message]:
        """The app's ASGI messages for ``request``, the response start naming this replica."""
        async for message in _run_asgi(self._app, request):
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self._id.encode())],
                }
            yield message

    async def check_health(self) -> None:
        """Ray's health check: the app's own ``/health`` (a model in error fails it)."""
        path = self._config.health_path
        if path is None:
            return
        probe = _Forwarded(
            scope={
                "type": "http",
                "http_version": "1.1",
                "method": "GET",
                "scheme": "http",
                "path": path,
                "raw_path": path.encode(),
                "query_string": b"",
                "headers": [(b"host", b"localhost")],
                "client": ("127.0.0.1", 0),
                "server": ("127.0.0.1", 0),
                "root_path": "",
            },
            body=b"",
        )
        async for message in _run_asgi(self._app, probe):
            if message["type"] == "http.response.start" and message["status"] != 200:
                raise RuntimeError(f"{path} answered {message['status']}")

    async def __del__(self) -> None:
        # Ray calls this after the requests under way have finished (or the graceful
        # shutdown timeout ran out): close the models.
        await self._lifespan.__aexit__(None, None, None)


async def _run_asgi(app: Any, request: _Forwarded) -> AsyncIterator[Message]:
    """Run ``app`` on one request, yielding what it sends; leaving early (the client went
    away) tells the app the client disconnected and cancels it. Streaming responses wait
    for that disconnect even after their last chunk, so it also comes once the response
    is complete."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            gone.set()  # as uvicorn does: once the response is out, receive() says disconnect

    async def run() -> None:
        try:
            await app(dict(request.scope), receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            yield message
        await task
    finally:
        gone.set()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


# --- the ingress ---------------------------------------------------------------------------


class OrtServeIngress:
    """Ray's HTTP ingress deployment: its ASGI app is :class:`_IngressApp`."""

    def __init__(self, replicas: DeploymentHandle[Any], config: ServerConfig, prefix_chars: int) -> None:
        app_name = serve.get_replica_context().app_name
        self._app = _IngressApp(
            replicas, config, prefix_chars, f"SERVE_REPLICA::{app_name}#{replicas.deployment_name}#"
        )

    def __serve_build_asgi_app__(self) -> _IngressApp:
        return self._app


class _IngressApp:
    """Reads each request, keys it, forwards it to a replica."""

    def __init__(
        self, replicas: DeploymentHandle[Any], config: ServerConfig, prefix_chars: int, replica_prefix: str
    ) -> None:
        self._streaming = replicas.options(stream=True)
        self._config = config
        self._prefix_chars = prefix_chars
        self._replica_prefix = replica_prefix
        """The start of the replicas' actor names, which end with their ids."""

    def _stream(self, request: _Forwarded) -> DeploymentResponseGenerator[Message]:
        return cast("DeploymentResponseGenerator[Message]", self._streaming.remote(request))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        body = await _read_body(receive, self._config.max_body_size)
        if body is None:
            await _send_error(send, 413, f"the request body is larger than {self._config.max_body_size} bytes")
            return
        plain = _plain_scope(scope)
        if self._config.metrics_path is not None and scope["path"] == self._config.metrics_path:
            await self._gather_metrics(plain, send)
            return
        request = _Forwarded(
            plain,
            body,
            affinity_key(scope["path"], body, self._prefix_chars),
            owner=response_owner(scope["method"], scope["path"], body),
        )
        await self._forward(request, send)

    async def _forward(self, request: _Forwarded, send: Send) -> None:
        # A replica that died before answering is retried once elsewhere (Ray takes it out
        # of the routing set as the call fails); once the answer started, it cannot be.
        for attempt in (1, 2):
            started = False
            try:
                async for message in self._stream(request):
                    started = True
                    await send(message)
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if started:
                    logger.warning("a replica died during a response; the client sees it cut")
                    return
                if attempt == 2:
                    await _send_error(send, 503, "no replica could take the request; retry later")
                    return

    async def _gather_metrics(self, scope: dict[str, Any], send: Send) -> None:
        """Every replica's metrics, each series labelled with its replica."""
        texts: dict[str, str] = {}
        # One at a time: calls made while handling one request share its internal id, by
        # which Ray's router matches a routing decision to the call waiting for it.
        for replica in _replica_ids(self._replica_prefix):
            try:
                status, headers, text = await self._collect(scope, replica)
            except (TimeoutError, ray.exceptions.RayError) as exc:  # gone since it was listed
                logger.warning("no metrics from replica %s: %r", replica, exc)
                continue
            if status != 200:  # the key is missing or wrong: every replica says the same
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": text.encode()})
                return
            texts[replica] = text
        body = merge_metrics(texts)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _collect(self, scope: dict[str, Any], replica: str) -> tuple[int, list[Any], str]:
        status, headers, chunks = 500, [], []
        async with asyncio.timeout(5):
            async for message in self._stream(_Forwarded(scope, b"", replica=replica)):
                if message["type"] == "http.response.start":
                    status, headers = message["status"], message.get("headers", [])
                elif message["type"] == "http.response.body":
                    chunks.append(message.get("body", b""))
        return status, headers, b"".join(chunks).decode()


def _replica_ids(prefix: str) -> list[str]:
    """The ids of the running replicas of a deployment (their actors are named after them)."""
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(n["name"][len(prefix) :] for n in names if n["name"].startswith(prefix))


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or ``None`` past ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _send_error(send: Send, status: int, message: str) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


# --- building the application --------------------------------------------------------------


def build_app(config: ServerConfig, options: RayOptions | None = None) -> serve.Application:
    """The Ray Serve application: run it with ``serve.run(build_app(config), route_prefix="/")``."""
    options = options or RayOptions()
    if options.replicas < 1:
        raise ValueError("replicas must be at least 1")
    deployment_options: dict[str, Any] = {
        "num_replicas": options.replicas,
        "ray_actor_options": {"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        "max_ongoing_requests": options.max_ongoing_requests,
        "health_check_period_s": options.health_check_period_s,
        "health_check_timeout_s": options.health_check_timeout_s,
        "graceful_shutdown_timeout_s": options.graceful_shutdown_timeout_s,
        **options.deployment_options,
    }
    if options.router == "prefix":
        if PrefixAffinityRouter is not None:
            deployment_options["request_router_config"] = RequestRouterConfig(
                request_router_class=PrefixAffinityRouter,  # type: ignore[arg-type,unused-ignore]  # a class or its path
                request_router_kwargs={"max_imbalance": options.max_imbalance},
            )
        else:  # pragma: no cover - a Ray without pluggable request routers
            logger.warning("this Ray has no pluggable request routers; using its default router")
    # Models load at replica start, in the lifespan, not on the first request.
    replica_config = replace(config, load_on_startup=True)
    replicas = serve.deployment(name="OrtServeReplica")(OrtServeReplica).options(**deployment_options)
    ingress = serve.deployment(name="OrtServeIngress")(serve.ingress()(OrtServeIngress)).options(
        ray_actor_options={"num_cpus": options.ingress_cpus},
        max_ongoing_requests=options.max_ongoing_requests * options.replicas,
    )
    app: serve.Application = ingress.bind(replicas.bind(replica_config), replica_config, options.prefix_chars)
    return app


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The application from ``key=value`` arguments, as Ray's ``serve run`` and serve
    config files (KubeRay's ``serveConfigV2``) pass them::

        serve run ortserve_server.ray:app_builder model=tiny=/models/tiny replicas=2

    ``model`` is ``NAME=PATH`` (several separated by commas); the others are
    ``replicas``, ``replica_cpus``, ``replica_gpus``, ``router`` (``prefix`` or
    ``default``), ``api_key``, ``state_url`` (a PostgreSQL database the replicas share:
    stored responses, files and batches; or ``state_dir``, a folder on a machine they
    share) and, for every model, ``provider``, ``engine``, ``threads`` (onnxruntime
    intra-op threads), ``max_batch_size``, ``max_sequence_length``, ``prefix_cache_mb``
    and ``kv_cache_dtype`` (``auto``, ``fp16`` or ``int8``: see ``ortserve serve --help``);
    ``mcp_server`` (``LABEL=URL`` or ``LABEL=stdio:COMMAND ARGS``, several separated by
    ``;``: each replica connects to them, or starts its own stdio processes) and
    ``allow_mcp_url`` (URL prefixes separated by commas): see ``--mcp-server``.
    """
    from ortserve_runtime import ModelConfig

    values = {key: str(value) for key, value in args.items()}
    unknown = sorted(set(values) - _BUILDER_ARGS)
    if unknown:
        raise ValueError(f"unknown arguments {', '.join(unknown)}; known: {', '.join(sorted(_BUILDER_ARGS))}")
    if "model" not in values:
        raise ValueError("pass model=NAME=PATH (several separated by commas)")
    models: dict[str, str | Path] = {}
    for item in values["model"].split(","):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"model: expected NAME=PATH, got {item!r}")
        models[name] = path
    router = values.get("router", "prefix")
    if router not in ("prefix", "default"):
        raise ValueError(f"router: expected prefix or default, got {router!r}")
    model_config = ModelConfig(
        provider=values.get("provider", "cpu"),  # type: ignore[arg-type]  # ModelConfig validates it
        engine=values.get("engine", "auto"),  # type: ignore[arg-type]
        intra_op_threads=int(values["threads"]) if "threads" in values else None,
        max_batch_size=int(values.get("max_batch_size", "32")),
        max_sequence_length=int(values.get("max_sequence_length", "4096")),
        prefix_cache_mb=float(values["prefix_cache_mb"]) if "prefix_cache_mb" in values else None,
        kv_cache_dtype=values.get("kv_cache_dtype", "auto"),  # type: ignore[arg-type]  # ModelConfig validates it
    )
    config = ServerConfig(
        models=models,
        model_config=model_config,
        api_key=values.get("api_key") or None,
        state_url=values.get("state_url") or None,
        state_dir=Path(values["state_dir"]) if values.get("state_dir") else None,
        mcp_servers=tuple(parse_mcp_server(spec.strip()) for spec in values.get("mcp_server", "").split(";") if spec),
        mcp_allowed_urls=tuple(url.strip() for url in values.get("allow_mcp_url", "").split(",") if url.strip()),
    )
    options = RayOptions(
        replicas=int(values.get("replicas", "2")),
        replica_cpus=float(values.get("replica_cpus", "1")),
        replica_gpus=float(values.get("replica_gpus", "0")),
        router="prefix" if router == "prefix" else "default",
    )
    return build_app(config, options)


_BUILDER_ARGS = {
    "model",
    "replicas",
    "replica_cpus",
    "replica_gpus",
    "router",
    "api_key",
    "provider",
    "engine",
    "threads",
    "max_batch_size",
    "max_sequence_length",
    "prefix_cache_mb",
    "kv_cache_dtype",
    "state_url",
    "state_dir",
    "mcp_server",
    "allow_mcp_url",
}
