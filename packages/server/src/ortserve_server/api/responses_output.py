"""The Responses API's output: items built from a generation's text, calls and finish,
and each step said as the typed stream events OpenAI sends."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from ortserve_client import protocol as p
from ortserve_client import responses_protocol as rp
from ortserve_runtime import ToolCall

from .._generation import sse_event
from .._ids import new_id
from .._mcp import McpTools

__all__ = ["_Output", "_as_input", "_usage"]

_encode = msgspec.json.Encoder().encode


class _Output:
    """Builds the output items from the generation's text, calls and finish, and says each
    step as the stream events OpenAI sends (the whole answer runs through it too, so both
    forms have the same items). ``sequence_number`` counts every event of the stream."""

    def __init__(self, summarize: bool = False, mcp: McpTools | None = None) -> None:
        self.mcp = mcp
        """The request's MCP servers: a call to one of their tools is an ``mcp_call`` (or an
        ``mcp_approval_request``), not a ``function_call`` for the client."""
        self.calling: list[rp.McpCallItem] = []
        """MCP calls the model wrote in the turn under way, for :class:`_Loop` to make."""
        self.items: list[rp.OutputItem] = []
        self.turn_start = 0
        """Where the items of the model turn under way begin."""
        self.sequence = 0
        self._message: rp.OutputMessage | None = None
        self._reasoning: rp.ReasoningItem | None = None
        self.summarize = summarize
        """Whether the reasoning item's ``summary`` carries the thinking too (asked for
        with ``reasoning.summary``; there is nothing shorter to give)."""

    def event(self, kind: type[Any], **fields: Any) -> bytes:
        event = kind(sequence_number=self.sequence, **fields)
        self.sequence += 1
        tag: str = kind.__struct_config__.tag
        return sse_event(event, tag)

    def reasoning(self, text: str) -> list[bytes]:
        """Thinking: the reasoning item opens at its first piece (it comes first: the
        think block starts the output) and closes when the answer or a call begins."""
        out = []
        item = self._reasoning
        if item is None:
            item = self._reasoning = rp.ReasoningItem(id=new_id("rs_"), status="in_progress")
            self.items.append(item)
            out.append(self.event(rp.OutputItemAddedEvent, output_index=len(self.items) - 1, item=item))
        where = {"item_id": item.id, "output_index": self.items.index(item)}
        if not item.content:  # the parts open at once, as OpenAI's stream opens them
            item.content.append(rp.ReasoningText(text=""))
            out.append(self.event(rp.ContentPartAddedEvent, content_index=0, part=rp.ReasoningText(text=""), **where))
            if self.summarize:
                item.summary.append(rp.SummaryText(text=""))
                summary = rp.SummaryText(text="")
                out.append(self.event(rp.ReasoningSummaryPartAddedEvent, summary_index=0, part=summary, **where))
        if text:
            item.content[0].text += text
            out.append(self.event(rp.ReasoningTextDeltaEvent, content_index=0, delta=text, **where))
            if self.summarize:
                item.summary[0].text += text
                out.append(self.event(rp.ReasoningSummaryTextDeltaEvent, summary_index=0, delta=text, **where))
        return out

    def close_reasoning(self, status: str = "completed") -> list[bytes]:
        item = self._reasoning
        if item is None:
            return []
        self._reasoning = None
        item.status = status  # type: ignore[assignment]  # one of the three, by the callers
        index = self.items.index(item)
        part = item.content[0]
        where = {"item_id": item.id, "output_index": index}
        out = [
            self.event(rp.ReasoningTextDoneEvent, content_index=0, text=part.text, **where),
            self.event(rp.ContentPartDoneEvent, content_index=0, part=part, **where),
        ]
        if self.summarize:
            summary = item.summary[0]
            out.append(self.event(rp.ReasoningSummaryTextDoneEvent, summary_index=0, text=summary.text, **where))
            out.append(self.event(rp.ReasoningSummaryPartDoneEvent, summary_index=0, part=summary, **where))
        out.append(self.event(rp.OutputItemDoneEvent, output_index=index, item=item))
        return out

    def text(self, text: str) -> list[bytes]:
        out = self.close_reasoning()
        message = self._message
        if message is None:
            message = self._message = rp.OutputMessage(id=new_id("msg_"), content=[], status="in_progress")
            self.items.append(message)
            index = len(self.items) - 1
            out.append(self.event(rp.OutputItemAddedEvent, output_index=index, item=message))
            message.content.append(rp.OutputText(text=""))
            out.append(
                self.event(
                    rp.ContentPartAddedEvent,
                    item_id=message.id,
                    output_index=index,
                    content_index=0,
                    part=rp.OutputText(text=""),
                )
            )
        if text:
            message.content[0].text += text
            where = {"item_id": message.id, "output_index": len(self.items) - 1, "content_index": 0}
            out.append(self.event(rp.OutputTextDeltaEvent, delta=text, **where))
        return out

    def close_message(self, status: str = "completed") -> list[bytes]:
        message = self._message
        if message is None:
            return []
        self._message = None
        message.status = status  # type: ignore[assignment]  # one of the three, by the callers
        part = message.content[0]
        where = {"item_id": message.id, "output_index": self.items.index(message), "content_index": 0}
        return [
            self.event(rp.OutputTextDoneEvent, text=part.text, **where),
            self.event(rp.ContentPartDoneEvent, part=part, **where),
            self.event(rp.OutputItemDoneEvent, output_index=where["output_index"], item=message),
        ]

    def call(self, call: ToolCall) -> list[bytes]:
        out = self.close_reasoning() + self.close_message()
        label = self.mcp.owner(call.name) if self.mcp is not None else None
        if label is not None:
            assert self.mcp is not None
            if self.mcp.needs_approval(label, call.name):
                request = rp.McpApprovalRequestItem(
                    id=new_id("mcpr_"), server_label=label, name=call.name, arguments=call.arguments
                )
                return out + self.added(request) + self.done(request)
            return out + self.mcp_call(label, call.name, call.arguments)
        item = rp.FunctionCallItem(
            id=new_id("fc_"),
            call_id="call_" + uuid.uuid4().hex[:24],
            name=call.name,
            arguments="",
            status="in_progress",
        )
        self.items.append(item)
        index = len(self.items) - 1
        out.append(self.event(rp.OutputItemAddedEvent, output_index=index, item=item))
        out.append(
            self.event(rp.FunctionCallArgumentsDeltaEvent, item_id=item.id, output_index=index, delta=call.arguments)
        )
        item.arguments, item.status = call.arguments, "completed"
        out.append(
            self.event(
                rp.FunctionCallArgumentsDoneEvent,
                item_id=item.id,
                output_index=index,
                arguments=call.arguments,
                name=call.name,
            )
        )
        out.append(self.event(rp.OutputItemDoneEvent, output_index=index, item=item))
        return out

    def added(self, item: rp.OutputItem) -> list[bytes]:
        self.items.append(item)
        return [self.event(rp.OutputItemAddedEvent, output_index=len(self.items) - 1, item=item)]

    def done(self, item: rp.OutputItem) -> list[bytes]:
        return [self.event(rp.OutputItemDoneEvent, output_index=self.items.index(item), item=item)]

    def listed(self, item: rp.McpListToolsItem) -> list[bytes]:
        where = {"item_id": item.id, "output_index": len(self.items)}
        out = self.added(item)
        out.append(self.event(rp.McpListToolsInProgressEvent, **where))
        out.append(self.event(rp.McpListToolsCompletedEvent, **where))
        return out + self.done(item)

    def mcp_call(self, label: str, name: str, arguments: str, approval: str | None = None) -> list[bytes]:
        """An MCP call opens (added, in progress, its arguments); :meth:`mcp_result` closes it."""
        item = rp.McpCallItem(
            id=new_id("mcp_"),
            server_label=label,
            name=name,
            arguments="",
            status="in_progress",
            approval_request_id=approval,
        )
        where = {"item_id": item.id, "output_index": len(self.items)}
        out = self.added(item)
        out.append(self.event(rp.McpCallInProgressEvent, **where))
        out.append(self.event(rp.McpCallArgumentsDeltaEvent, delta=arguments, **where))
        item.arguments = arguments
        out.append(self.event(rp.McpCallArgumentsDoneEvent, arguments=arguments, **where))
        self.calling.append(item)
        return out

    def mcp_result(self, item: rp.McpCallItem) -> list[bytes]:
        failed = item.error is not None
        item.status = "failed" if failed else "completed"
        where = {"item_id": item.id, "output_index": self.items.index(item)}
        kind = rp.McpCallFailedEvent if failed else rp.McpCallCompletedEvent
        return [self.event(kind, **where), *self.done(item)]

    def finish(self, reason: str) -> list[bytes]:
        """The end of a turn: an answer with neither text nor calls is one empty message
        (so that ``output_text`` is ``""``, not missing), after any reasoning (which
        ``max_tokens`` may have cut short: then it is incomplete)."""
        status = "incomplete" if reason == "length" else "completed"
        out = self.close_reasoning(status)
        if all(isinstance(item, rp.ReasoningItem) for item in self.items[self.turn_start :]):
            out += self.text("")
        return out + self.close_message(status)

    def feed(self, reasoning: str, text: str, calls: list[ToolCall], reason: str | None) -> list[bytes]:
        out = self.reasoning(reasoning) if reasoning else []
        out += self.text(text) if text else []
        for call in calls:
            out += self.call(call)
        if reason is not None:
            out += self.finish(reason)
        return out


def _usage(usage: p.CompletionUsage, reasoning_tokens: int) -> rp.ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return rp.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_tokens_details=rp.InputTokensDetails(cached_tokens=cached),
        output_tokens_details=rp.OutputTokensDetails(reasoning_tokens=reasoning_tokens),
    )


def _as_input(item: rp.OutputItem) -> rp.InputItem:
    """An output item as the input item a follow-up hands back."""
    if isinstance(item, rp.OutputMessage):
        return rp.InputMessage(role="assistant", content=list(item.content), id=item.id)
    return item
