"""Reasoning ("thinking") models: their markup, a streaming splitter, and grammars that
leave the reasoning free.

Qwen3, the DeepSeek-R1 distills and Phi-4-reasoning write their reasoning between
``<think>`` and ``</think>`` before the answer; some templates open the block in the
generation prompt themselves (then the output starts inside it). The markers are matched
in the decoded text, not as token ids: in these models they are added tokens that are
not "special" (they survive decoding), and a small vocabulary may spell them in pieces.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer, decoders

__all__ = [
    "ReasoningBudget",
    "ReasoningMarkers",
    "ReasoningParser",
    "ReasoningStart",
    "detect_reasoning",
    "reasoning_prefix_lark",
    "reasoning_start",
]

ReasoningStart = Literal["opens", "open"]
"""How a generation begins: ``opens``: the model opens its think block itself (or answers
at once); ``open``: the prompt opened it, so the output starts inside the reasoning."""


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    start: str = "<think>"
    end: str = "</think>"


def detect_reasoning(template_source: str | None) -> ReasoningMarkers | None:
    """The think markers a chat template teaches (it writes or strips both), if any."""
    if template_source and "<think>" in template_source and "</think>" in template_source:
        return ReasoningMarkers()
    return None


def reasoning_start(markers: ReasoningMarkers | None, prompt_text: str) -> ReasoningStart | None:
    """Where the output of ``prompt_text`` begins: inside a think block the template
    opened, before one the model may open, or ``None`` when the template closed it
    (Qwen3 with ``enable_thinking: false`` renders an empty ``<think></think>``)."""
    if markers is None:
        return None
    tail = prompt_text.rstrip()
    if tail.endswith(markers.end):
        return None
    if tail.endswith(markers.start):
        return "open"
    return "opens"


class ReasoningParser:
    """Splits streamed text into reasoning and answer, like :class:`ToolCallParser`.

    ``feed`` returns ``(reasoning, answer)`` safe to show now; text that may be part of a
    marker split across tokens is held back until it is decided. Whitespace around the
    markers (Qwen3 writes ``<think>\\n...\\n</think>\\n\\n``) belongs to neither part.
    Only a think block at the very start counts: ``<think>`` later in an answer is text.
    """

    def __init__(self, markers: ReasoningMarkers, start: ReasoningStart) -> None:
        self._markers = markers
        # "before": not yet known whether a block opens; "in": reasoning; "after": answer.
        self._state = "in" if start == "open" else "before"
        self._buffer = ""
        self._leading = True  # strip whitespace at the start of the current part

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            if self._state == "before":
                stripped = self._buffer.lstrip()
                if stripped.startswith(self._markers.start):
                    self._buffer = stripped[len(self._markers.start) :]
                    self._state, self._leading = "in", True
                    continue
                if not stripped or self._markers.start.startswith(stripped):
                    break  # still undecided
                self._state, self._leading = "after", False  # no think block: all answer
                continue
            if self._state == "in":
                if self._leading:
                    self._buffer = self._buffer.lstrip()
                    if not self._buffer:
                        break
                    self._leading = False
                end = self._buffer.find(self._markers.end)
                if end >= 0:
                    reasoning.append(self._buffer[:end].rstrip())
                    self._buffer = self._buffer[end + len(self._markers.end) :]
                    self._state, self._leading = "after", True
                    continue
                # Hold back a possible partial end marker and trailing whitespace (which
                # belongs to the marker if it follows).
                keep = len(self._buffer) - _held(self._buffer, self._markers.end)
                safe = self._buffer[:keep].rstrip()
                reasoning.append(safe)
                self._buffer = self._buffer[len(safe) :]
                break
            if self._leading:
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    break
                self._leading = False
            answer.append(self._buffer)
            self._buffer = ""
            break
        return "".join(reasoning), "".join(answer)

    def finish(self) -> tuple[str, str]:
        """Settle what is held back: an unfinished block (cut by ``max_tokens``) is
        reasoning; an undecided start is answer."""
        rest, self._buffer = self._buffer, ""
        if self._state == "in":
            return (rest.strip() if self._leading else rest.rstrip()), ""
        return "", rest.strip() if self._leading else rest

    @property
    def reasoning_done(self) -> bool:
        """Whether the answer has begun (the think block closed, or none opened)."""
        return self._state == "after"

    @property
    def in_reasoning(self) -> bool:
        """Whether the output is inside the think block now (so the token just fed, if
        the block was open before it, was reasoning; this is how reasoning tokens are
        counted)."""
        return self._state == "in"


def _held(text: str, marker: str) -> int:
    """Length (shared with the tool-call parser) of the longest suffix of ``text`` that starts ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


def reasoning_prefix_lark(markers: ReasoningMarkers, start: ReasoningStart) -> str:
    """The Lark rules (llguidance syntax) of a free think block followed by the grammar
    ``@inner``: ``lazy`` ends the block at the first end marker, so the reasoning is any
    text without one; the whitespace after it is free, then the constraint applies."""
    opening = "" if start == "open" else _lark_string(markers.start)
    return (
        f"start: think gap @inner\ngap: /[ \\t\\n]*/\nthink[lazy]: {opening} /(.|\\n)*/ {_lark_string(markers.end)}\n"
    )


def _lark_string(text: str) -> str:
    return '"' + re.sub(r'(["\\])', r"\\\1", text) + '"'


class _Matcher(Protocol):
    """What the budget wraps: a grammar's :class:`~._constraints.Constraint` (named by its
    shape: ``_constraints`` imports this module)."""

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]: ...
    def advance(self, token: int) -> bool: ...
    @property
    def error(self) -> str | None: ...


class ReasoningBudget:
    """A reasoning model's thinking held to ``budget`` tokens: once that many are reasoning,
    the think block's end marker (``end_ids``) is forced, token by token, and the answer
    follows; the model may end it sooner itself. It stands where a grammar constraint
    stands (:class:`~._constraints.Constraint`'s ``mask``/``advance``/``error``) and wraps
    the request's own, if any (a grammar for the answer, which leaves the reasoning free).
    The think block is followed in the decoded text, as :class:`ReasoningParser` does."""

    def __init__(
        self,
        budget: int,
        markers: ReasoningMarkers,
        start: ReasoningStart,
        end_ids: Sequence[int],
        tokenizer: Tokenizer,
        inner: _Matcher | None = None,
    ) -> None:
        self._left = budget
        self._parser = ReasoningParser(markers, start)
        self._end_ids = list(end_ids)
        self._forcing: list[int] = []
        self._tokenizer = tokenizer
        self._decoder = decoders.DecodeStream(skip_special_tokens=False)
        self._inner = inner
        if start == "open" and budget == 0:
            self._forcing = list(self._end_ids)

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        masked = self._inner.mask(logits) if self._inner is not None else logits
        if not self._forcing:
            return masked
        forced = np.full_like(logits, -np.inf)
        forced[..., self._forcing[0]] = 0.0
        return forced

    def advance(self, token: int) -> bool:
        was_in = self._parser.in_reasoning
        self._parser.feed(self._decoder.step(self._tokenizer, token) or "")
        if self._forcing and token == self._forcing[0]:
            self._forcing.pop(0)
        elif was_in or self._parser.in_reasoning:
            self._left -= 1
            if self._left <= 0 and self._parser.in_reasoning and not self._forcing:
                self._forcing = list(self._end_ids)
        return self._inner.advance(token) if self._inner is not None else False

    @property
    def error(self) -> str | None:
        return self._inner.error if self._inner is not None else None
