"""The API's routes, one module per API family, over the shared plumbing of the package
above (``_generation``: streams and their delivery; ``_mapping``: requests checked and
planned; ``_leases``, ``_errors``)."""

from __future__ import annotations

from .anthropic import anthropic_exception_handlers, anthropic_route_handlers
from .audio import transcriptions
from .batches import batch_route_handlers
from .chat import chat_completions
from .completions import completions
from .control import control_route_handlers
from .embeddings import embeddings
from .health import health_handler, metrics_handler
from .models import list_models, model_card, retrieve_model
from .rerank import rerank, rerank_alias, score
from .responses import responses_route_handlers
from .speech import speech_route_handlers
from .tokenize import detokenize, tokenize
from .usage import usage

__all__ = [
    "anthropic_exception_handlers",
    "anthropic_route_handlers",
    "api_route_handlers",
    "batch_route_handlers",
    "control_route_handlers",
    "health_handler",
    "metrics_handler",
    "model_card",
    "openai_route_handlers",
    "rerank_alias_handlers",
    "responses_route_handlers",
    "usage_handler",
]

api_route_handlers = [
    chat_completions,
    completions,
    embeddings,
    rerank,
    score,
    transcriptions,
    list_models,
    retrieve_model,
    tokenize,
    detokenize,
]
"""The OpenAI-shaped routes under the API's prefix (those the Batch API can run too)."""
openai_route_handlers = [*api_route_handlers, *responses_route_handlers, *speech_route_handlers]
"""Every OpenAI-shaped route under the API's prefix."""
rerank_alias_handlers = [rerank_alias]
"""Served at the root, beside the API's own prefix."""
usage_handler = usage
"""``GET /usage``: behind the admin key, where one is set."""
