"""An Anthropic Messages request as the chat completion it means (system, content blocks,
tools, tool choice, thinking, MCP servers), and the field at fault named as Anthropic
names it (``messages.1.content.0.source``) when the chat path refuses something."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from litestar import Request
from ortserve_client import anthropic_protocol as a
from ortserve_client import protocol as p
from ortserve_runtime import ChatModel, InvalidRequestError, Prompt

from .._errors import (
    BadRequestError,
    ServerError,
    UnsupportedParameterError,
)
from .._leases import require_model
from .._mcp import McpTools
from .._plan import MAX_STOP, check_tool_count, prepare_chat
from .._state import OrtServe

__all__ = ["_Mapped", "_add_mcp_servers", "_counted_prompt", "_map", "_named"]


_OPENAI_PATH = re.compile(r"messages\[(\d+)\](?:\.content\[(\d+)\])?(.*)")
_RENAMED = {
    "stop": "stop_sequences",
    "n": "messages",
    "prompt": "messages",
    "reasoning_budget": "thinking.budget_tokens",
}


@dataclass
class _Mapped:
    """An Anthropic request as the chat completion it means, and where each OpenAI
    message and content part came from (for errors that name the field at fault)."""

    request: p.ChatCompletionRequest
    messages: list[str] = field(default_factory=list)
    """Per OpenAI message: its Anthropic path (``messages.3``)."""
    parts: list[list[str]] = field(default_factory=list)
    """Per OpenAI message, per content part: its Anthropic path."""

    def add(self, message: p.ChatMessage, path: str, parts: Sequence[str] = ()) -> None:
        self.request.messages.append(message)
        self.messages.append(path)
        self.parts.append(list(parts))

    def param(self, param: str | None) -> str | None:
        """An OpenAI-side field name as Anthropic's request names it."""
        if param is None:
            return None
        found = _OPENAI_PATH.fullmatch(param)
        if found is None:
            return _RENAMED.get(param, param)
        message, part, rest = int(found[1]), found[2], found[3]
        if message >= len(self.messages):
            return "messages"
        if part is None or int(part) >= len(self.parts[message]):
            return self.messages[message]
        return self.parts[message][int(part)] + (".source" if rest.startswith(".image_url") else rest)


def _text(blocks: str | Sequence[a.TextBlockParam]) -> str:
    return blocks if isinstance(blocks, str) else "\n".join(block.text for block in blocks)


def _image(block: a.ImageBlockParam) -> p.ImageContentPart:
    """An image block as the OpenAI image part the chat path decodes (inline data as a
    ``data:`` URL, a URL source through the same allow-list as OpenAI image URLs)."""
    source = block.source
    if isinstance(source, a.Base64ImageSource):
        return p.ImageContentPart(image_url=p.ImageURL(url=f"data:{source.media_type};base64,{source.data}"))
    return p.ImageContentPart(image_url=p.ImageURL(url=source.url))


def _tool_result(block: a.ToolResultBlockParam, path: str) -> p.ToolMessage:
    content = block.content if not isinstance(block.content, msgspec.UnsetType) else ""
    if not isinstance(content, str):
        for number, item in enumerate(content):
            if isinstance(item, a.ImageBlockParam):
                raise BadRequestError(
                    "images in a tool_result are not supported: chat templates take text from tools",
                    param=f"{path}.content.{number}",
                )
        content = _text([item for item in content if isinstance(item, a.TextBlockParam)])
    if block.is_error is True:  # chat templates have no error flag: the model reads it
        content = f"Error: {content}"
    return p.ToolMessage(content=content, tool_call_id=block.tool_use_id)


def _user(mapped: _Mapped, message: a.MessageParam, path: str) -> None:
    """Tool results first, as separate tool messages (Anthropic puts them at the start
    of a user turn), then the rest of the turn as one user message."""
    if isinstance(message.content, str):
        mapped.add(p.UserMessage(content=message.content), path)
        return
    parts: list[p.ContentPart] = []
    origins: list[str] = []
    for number, block in enumerate(message.content):
        where = f"{path}.content.{number}"
        if isinstance(block, a.ToolResultBlockParam):
            mapped.add(_tool_result(block, where), where)
        elif isinstance(block, a.TextBlockParam | a.ImageBlockParam):
            parts.append(p.TextContentPart(text=block.text) if isinstance(block, a.TextBlockParam) else _image(block))
            origins.append(where)
        else:
            raise BadRequestError(f"a user message cannot hold a {block.__struct_config__.tag} block", param=where)
    if parts:
        mapped.add(p.UserMessage(content=parts), path, origins)


def _assistant(mapped: _Mapped, message: a.MessageParam, path: str) -> None:
    if isinstance(message.content, str):
        mapped.add(p.AssistantMessage(content=message.content), path)
        return
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[p.ToolCall] = []

    def turn() -> None:
        # Thinking goes to the template as chat completions pass it; the template decides
        # what of it the model sees (Qwen3's: only the thinking of the turn in progress).
        thought = "\n\n".join(thoughts) if thoughts else msgspec.UNSET
        content = "".join(texts)
        mapped.add(
            # A copy: the list is cleared for the next turn (the message lost its calls, so the
            # template rendered the assistant's tool_use blocks as nothing).
            p.AssistantMessage(content=content, tool_calls=[*calls] or msgspec.UNSET, reasoning_content=thought),
            path,
        )
        texts.clear()
        thoughts.clear()
        calls.clear()

    for number, block in enumerate(message.content):
        if isinstance(block, a.TextBlockParam):
            texts.append(block.text)
        elif isinstance(block, a.ThinkingBlockParam):
            thoughts.append(block.thinking)
        elif isinstance(block, a.ToolUseBlockParam | a.McpToolUseBlockParam):
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append(p.ToolCall(id=block.id, function=p.FunctionCall(name=block.name, arguments=arguments)))
        elif isinstance(block, a.McpToolResultBlockParam):
            # The server made the call within the turn: the model read its result and went on.
            if texts or thoughts or calls:
                turn()
            given = block.content
            content: str | list[a.TextBlockParam | a.ImageBlockParam] | msgspec.UnsetType = (
                given if isinstance(given, str | msgspec.UnsetType) else list(given)
            )
            result = a.ToolResultBlockParam(tool_use_id=block.tool_use_id, content=content, is_error=block.is_error)
            where = f"{path}.content.{number}"
            mapped.add(_tool_result(result, where), where)
        elif not isinstance(block, a.RedactedThinkingBlockParam):  # redacted: unreadable, dropped
            raise BadRequestError("an assistant message cannot hold an image block", param=f"{path}.content.{number}")
    if texts or thoughts or calls or not message.content:
        turn()


def _tool_choice(choice: a.ToolChoice | msgspec.UnsetType) -> tuple[Any, bool | msgspec.UnsetType]:
    """OpenAI's ``tool_choice`` (``any`` is ``required``) and ``parallel_tool_calls``."""
    if isinstance(choice, msgspec.UnsetType):
        return msgspec.UNSET, msgspec.UNSET
    parallel = False if getattr(choice, "disable_parallel_tool_use", None) is True else msgspec.UNSET
    if isinstance(choice, a.ToolChoiceTool):
        return p.NamedToolChoice(function=p.NamedToolChoiceFunction(name=choice.name)), parallel
    return {"any": "required"}.get(str(choice.__struct_config__.tag), str(choice.__struct_config__.tag)), parallel


def _thinking(data: a.MessagesRequest | a.CountTokensRequest, model: ChatModel) -> dict[str, Any]:
    """The template variables of ``thinking``: a reasoning model thinks only when asked
    (Anthropic's default is off), through ``enable_thinking`` (Qwen3's variable; a
    template that always thinks, as DeepSeek-R1's, ignores it and thinks anyway)."""
    thinking = data.thinking
    kind = thinking.get("type") if isinstance(thinking, dict) else "disabled"
    if kind not in ("enabled", "adaptive", "disabled"):
        raise BadRequestError("thinking.type must be 'enabled', 'adaptive' or 'disabled'", param="thinking.type")
    budget = thinking.get("budget_tokens") if isinstance(thinking, dict) else None
    if kind == "enabled":
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise BadRequestError("thinking.budget_tokens must be a positive integer", param="thinking.budget_tokens")
        # Unlike Anthropic, a budget under 1,024 (small local models think briefly) or at
        # least max_tokens (which then ends the thinking first) is taken: each does what it says.
    elif isinstance(thinking, dict) and "budget_tokens" in thinking:  # it was taken and ignored
        raise BadRequestError(
            f"thinking.budget_tokens is for thinking of type 'enabled', not {kind!r}", param="thinking.budget_tokens"
        )
    if model.reasoning is None:
        if kind != "disabled":
            raise UnsupportedParameterError(
                f"'thinking' is not supported: model {model.name!r} does not reason", param="thinking"
            )
        return {}  # other templates are left as they are
    return {"enable_thinking": kind != "disabled"}


def _map(data: a.MessagesRequest | a.CountTokensRequest, model: ChatModel, mcp: McpTools | None = None) -> _Mapped:
    """The chat completion an Anthropic request means (refusing what it cannot mean);
    ``mcp``: the request's MCP servers, whose tools follow the request's own."""
    check_tool_count(data.tools)
    template_variables = _thinking(data, model)
    choice, parallel = _tool_choice(data.tool_choice)
    tools: list[p.Tool] | msgspec.UnsetType = msgspec.UNSET
    if not isinstance(data.tools, msgspec.UnsetType):
        for number, tool in enumerate(data.tools):
            if tool.input_schema.get("type") != "object":  # as Anthropic refuses it
                raise BadRequestError(
                    f"tools.{number}.input_schema.type: Field required to be 'object'",
                    param=f"tools.{number}.input_schema.type",
                )
        tools = [
            p.Tool(function=p.FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
            for t in data.tools
        ]
    if mcp is not None and mcp.uses:
        tools = [*(tools or []), *mcp.chat_tools()]
    request = p.ChatCompletionRequest(
        model=data.model,
        messages=[],
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=template_variables or msgspec.UNSET,
    )
    if isinstance(data, a.MessagesRequest):
        if data.service_tier not in (msgspec.UNSET, "auto", "standard_only"):
            raise UnsupportedParameterError(
                f"service_tier {data.service_tier!r} is not supported: this server has one tier", param="service_tier"
            )
        if not isinstance(data.temperature, msgspec.UnsetType) and not 0 <= data.temperature <= 1:
            raise BadRequestError("temperature must be between 0 and 1", param="temperature")
        if data.max_tokens < 1:
            raise BadRequestError("max_tokens must be at least 1", param="max_tokens")
        if isinstance(data.stop_sequences, list) and not all(data.stop_sequences):
            raise BadRequestError("stop_sequences: a stop sequence must not be empty", param="stop_sequences")
        if isinstance(data.stop_sequences, list) and len(data.stop_sequences) > MAX_STOP:
            # The chat check's own words name OpenAI's field.
            raise BadRequestError(
                f"stop_sequences: this server takes at most {MAX_STOP} stop sequences, not {len(data.stop_sequences)}",
                param="stop_sequences",
            )
        thinking = data.thinking if isinstance(data.thinking, dict) else {}
        request = msgspec.structs.replace(
            request,
            # budget_tokens bounds the thinking (checked positive above, with thinking enabled).
            reasoning_budget=thinking["budget_tokens"] if thinking.get("type") == "enabled" else msgspec.UNSET,
            cache_salt=data.cache_salt,
            max_tokens=data.max_tokens,
            temperature=data.temperature,
            top_p=data.top_p,
            top_k=data.top_k,
            stop=data.stop_sequences,
        )
    mapped = _Mapped(request)
    if not isinstance(data.system, msgspec.UnsetType):
        mapped.add(p.SystemMessage(content=_text(data.system)), "system")
    for number, message in enumerate(data.messages):
        (_user if message.role == "user" else _assistant)(mapped, message, f"messages.{number}")
    if data.messages and data.messages[-1].role == "assistant":
        # Anthropic continues a final assistant turn; a chat template would open a new one.
        raise BadRequestError(
            "a final assistant message (prefill) is not supported: end with a user message",
            param=f"messages.{len(data.messages) - 1}",
        )
    return mapped


@contextlib.contextmanager
def _named(mapped: _Mapped) -> Iterator[None]:
    """A refusal raised inside names Anthropic's field (as ``mapped`` renames OpenAI's)."""
    try:
        yield
    except (ServerError, InvalidRequestError) as exc:
        exc.param = mapped.param(exc.param)
        raise


async def _counted_prompt(data: a.CountTokensRequest, state: OrtServe, request: Request[Any, Any, Any]) -> Prompt:
    """The prompt a message request would run (counting tokens queues nothing)."""
    model = await require_model(state, data.model)
    mapped = _Mapped(p.ChatCompletionRequest(model=data.model, messages=[]))
    with _named(mapped):
        mapped = _map(data, model)
    with _named(mapped):
        _, prompt = await prepare_chat(state, model, mapped.request, request, queue=False)
    return prompt


async def _add_mcp_servers(data: a.MessagesRequest, mcp: McpTools) -> None:
    """Connects the request's ``mcp_servers`` and lists their tools (refusing what the
    operator did not allow: a name that is not configured needs an allowed ``url``)."""
    for number, server in enumerate(data.mcp_servers or []):
        param = f"mcp_servers.{number}"
        configured = server.name in mcp.hub.servers
        token = server.authorization_token if isinstance(server.authorization_token, str) else None
        if token and configured:
            raise BadRequestError(
                f"MCP server {server.name!r} is configured on this server, with the operator's credentials; "
                "a request may not send its own authorization_token",
                param=f"{param}.authorization_token",
            )
        config = server.tool_configuration if isinstance(server.tool_configuration, a.McpToolConfiguration) else None
        enabled = config is None or config.enabled is not False
        names = config.allowed_tools if config is not None and isinstance(config.allowed_tools, list) else None
        await mcp.add(
            server.name,
            param,
            url=None if configured else server.url,
            headers={"Authorization": f"Bearer {token}"} if token else None,
            allowed=lambda tool, names=names, enabled=enabled: enabled and (names is None or tool.name in names),  # type: ignore[misc]
            approval="never",  # Anthropic's connector has no approvals: the operator chose the servers
        )
