"""``POST /v1/tokenize`` and ``/v1/detokenize``."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from litestar import Request, post
from litestar.di import NamedDependency
from litestar.params import JSONBody
from ortserve_client import protocol as p
from ortserve_runtime import ChatModel, ContextLengthError

from .._connection import fetching_while_connected
from .._errors import (
    BadRequestError,
)
from .._leases import require_model
from .._messages import chat_messages
from .._openapi import POST_ERRORS, error_responses
from .._plan import check_tool_count
from .._state import OrtServe

__all__ = ["detokenize", "tokenize"]


@post(
    "/tokenize",
    status_code=200,
    summary="Tokenize a prompt or chat messages (extension)",
    responses=error_responses(*POST_ERRORS),
)
async def tokenize(
    data: JSONBody[p.TokenizeRequest], ortserve: NamedDependency[OrtServe], request: Request[Any, Any, Any]
) -> p.TokenizeResponse:
    check_tool_count(data.tools)
    model = await require_model(ortserve, data.model)
    has_prompt = not isinstance(data.prompt, msgspec.UnsetType)
    has_messages = not isinstance(data.messages, msgspec.UnsetType)
    if has_prompt == has_messages:
        raise BadRequestError("give exactly one of 'prompt' or 'messages'", param="prompt")
    for name in ("tools", "chat_template_kwargs", "add_generation_prompt"):
        if has_prompt and getattr(data, name) not in (msgspec.UNSET, None):
            raise BadRequestError(f"'{name}' goes with 'messages' (a prompt is tokenized as it is)", param=name)
    if has_messages:
        assert not isinstance(data.messages, msgspec.UnsetType)
        # Remote images are fetched as for a chat: stopped when the client leaves.
        messages = await chat_messages(
            data.messages, ortserve.config, model, fetching_while_connected(request, ortserve)
        )
        tools = [msgspec.to_builtins(tool) for tool in data.tools] if isinstance(data.tools, list) else None
        kwargs = data.chat_template_kwargs if isinstance(data.chat_template_kwargs, dict) else None
        prompt = await model.aprepare_chat(
            messages,
            tools=tools or None,
            add_generation_prompt=data.add_generation_prompt is not False,
            template_kwargs=kwargs,
        )
        tokens = list(prompt)  # a multimodal prompt counts each image as the features it becomes
    else:
        assert isinstance(data.prompt, str)
        tokens = await asyncio.to_thread(_checked_encode, model, data.prompt)
    if has_messages and len(tokens) > model.max_sequence_length:
        # Bounded by what the model holds, as a chat is.
        raise ContextLengthError(
            f"the prompt the chat template made of the messages and tools has {len(tokens)} tokens, more than "
            f"this model's limit of {model.max_sequence_length} tokens",
            param="messages",
        )
    return p.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=model.max_sequence_length)


@post(
    "/detokenize",
    status_code=200,
    summary="Turn token ids back into text (extension)",
    responses=error_responses(*POST_ERRORS),
)
async def detokenize(data: JSONBody[p.DetokenizeRequest], ortserve: NamedDependency[OrtServe]) -> p.DetokenizeResponse:
    model = await require_model(ortserve, data.model)
    # Bounded as /tokenize's prompt is, by what the model can hold: the tokenizer's decode
    # holds the GIL throughout (2,000,000 ids held the event loop 650 ms).
    if len(data.tokens) > model.max_sequence_length:
        raise BadRequestError(
            f"tokens has {len(data.tokens)} ids, more than this model's {model.max_sequence_length}", param="tokens"
        )
    return p.DetokenizeResponse(prompt=await asyncio.to_thread(model.decode, data.tokens))


TOKENIZE_TOKENS = 1 << 17
TOKENIZE_CHARS = 1 << 17
"""A ``prompt`` sent to /tokenize of up to :data:`TOKENIZE_CHARS` characters may have up to
:data:`TOKENIZE_TOKENS` tokens, more than the context holds: a document is tokenized to be
cut into windows (a perplexity run) or counted, not to be generated from. A longer one is
held to the context. Either is refused with no more tokens built than its bound (where the
text cannot be cut into windows, the characters bound its tokens: 4 at most for one, so
+120 MiB at worst; 990,000 characters of 4 tokens each were 3.96 M ids, +700 MiB:
seventeenth probe, issue 45)."""


def _checked_encode(model: ChatModel, prompt: str) -> list[int]:
    """``prompt``'s tokens, within its bound (a worker thread's work: the length bound's
    first use scans the vocabulary)."""
    limit = (
        model.max_sequence_length if len(prompt) > TOKENIZE_CHARS else max(TOKENIZE_TOKENS, model.max_sequence_length)
    )
    model.check_prompt_size(prompt, limit=limit)  # counted a window at a time, where it can be
    tokens = model.encode(prompt)
    if len(tokens) > limit:  # a text of one window is counted here
        whose = "this model's limit" if limit == model.max_sequence_length else "the limit"
        raise ContextLengthError(
            f"the prompt has {len(tokens)} tokens, more than {whose} of {limit} tokens", param="prompt"
        )
    return tokens
