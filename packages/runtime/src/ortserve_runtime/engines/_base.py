"""The back of a generative model: the :class:`Engine` protocol and what an engine can do.

Every engine is built on the owner-thread bridge (:class:`~.._threads.OwnerThread`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

from ..chat._request import Request

__all__ = ["Engine", "EngineCapabilities"]


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
