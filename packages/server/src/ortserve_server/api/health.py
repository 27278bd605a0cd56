"""``/health`` and ``/metrics``."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import HttpMethod, Request, Response, route
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from ortserve_client import protocol as p

from .._leases import presents_key
from .._openapi import GET_ERRORS, error_responses
from .._state import OrtServe
from .._usage import usage_per_key_shown

__all__ = ["health_handler", "metrics_handler"]


# HEAD too: load balancers probe with it (it was a 405; sixteenth probe).
@route(
    "/",
    http_method=[HttpMethod.GET, HttpMethod.HEAD],
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


@route(
    "/",
    http_method=[HttpMethod.GET, HttpMethod.HEAD],
    summary="Prometheus metrics",
    media_type="text/plain; version=0.0.4",
    responses=error_responses(*GET_ERRORS),
)
async def metrics_handler(ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]) -> bytes:
    """Every model's load, and usage per key label where the caller may see every key's
    traffic: without an admin key, anyone the route lets in; with one, its holder."""
    for name in ortserve.registry.names():
        model = ortserve.registry.loaded(name)  # every kind: generative, speech, embedding, rerank
        if model is None:
            ortserve.metrics.set_load(name, None, None)
        else:
            ortserve.metrics.set_load(name, model.queued, model.active)
    admin_key = ortserve.config.admin_key
    shown = usage_per_key_shown.set(admin_key is None or presents_key(request.scope["headers"], admin_key))
    try:
        return ortserve.metrics.render()
    finally:
        usage_per_key_shown.reset(shown)
