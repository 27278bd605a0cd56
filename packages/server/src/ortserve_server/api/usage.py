"""``GET /v1/usage`` (extension): requests, errors and tokens per API key label and model,
as the state database keeps them (LiteLLM's proxy reports spend per key the same way).
It shows every key's traffic, so it needs the admin key where one is set."""

from __future__ import annotations

from litestar import get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from ortserve_client import protocol as p

from .._openapi import GET_ERRORS, error_responses
from .._state import OrtServe

__all__ = ["usage"]


@get(
    "/usage",
    summary="Usage per API key (extension)",
    description="Requests, errors, input and output tokens per API key label (never the key) and model, "
    "since the state database began (they outlive restarts). `key` and `model` narrow the list.",
    responses=error_responses(*GET_ERRORS),
)
async def usage(
    ortserve: NamedDependency[OrtServe], key: FromQuery[str | None] = None, model: FromQuery[str | None] = None
) -> p.KeyUsageList:
    totals = await ortserve.usage.stored()
    return p.KeyUsageList(
        data=[
            p.KeyUsage(
                key=label,
                model=name,
                requests=t.requests,
                errors=t.errors,
                input_tokens=t.input_tokens,
                output_tokens=t.output_tokens,
            )
            for (label, name), t in sorted(totals.items())
            if (key is None or label == key) and (model is None or name == model)
        ]
    )
