"""Grammar-constrained decoding with llguidance, on the host side of each request.

Every step the request's matcher says which tokens may come next; the others are masked
out of that request's logits before sampling, so the output always matches: JSON that
parses and validates against a schema, a regular expression, or a Lark grammar.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from .._errors import InvalidRequestError
from .._fair_threads import FairThreads
from .._memory import resident_memory
from ._grammar_depth import MAX_GRAMMAR_DEPTH, MAX_SCHEMA_DEPTH, json_schema_depth, lark_depth, lark_json_depth
from ._large_stack import on_large_stack
from ._reasoning import ReasoningMarkers, ReasoningStart, reasoning_prefix_lark

if TYPE_CHECKING:
    from pathlib import Path

    # Imported where a grammar is first used: 25-60 ms of every server's start-up otherwise.
    import llguidance

__all__ = ["Constraint", "Grammar", "GrammarCompiler", "closed_schema", "strict_whitespace"]


@dataclass(frozen=True, slots=True)
class Grammar:
    """What the output must match. ``json_schema`` takes a schema dict (``{"type":
    "object"}`` for any JSON object); ``regex`` and ``lark`` take their source text."""

    kind: Literal["json_schema", "regex", "lark"]
    source: str | dict[str, Any]
    after_reasoning: tuple[ReasoningMarkers, ReasoningStart] | None = None
    """Set for a reasoning model: the grammar holds for the answer only, after a free
    think block (opened by the model, or already open in the prompt)."""
    beside: tuple[str, Grammar] | None = None
    """``(field, grammar)``: a request field's grammar that does not hold for this output but
    must compile all the same (a response format beside a forced call shapes the text turns
    after it; twenty-fourth probe, issue 45: one that could not compile was taken, 200)."""
    blame_unless: tuple[str, Grammar, Grammar] | None = None
    """``(field, part, own)``: when this grammar is refused and ``part`` alone is not, the
    fault is the request field ``field``'s (a response format beside tools: the tools alone
    compile; twenty-third probe, issue 45: its errors were named ``tools``), told as ``own``
    (the field's grammar alone) is refused, not in this grammar's lines the server wrote
    (twenty-seventh probe)."""

    def og_guidance(self) -> tuple[str, str]:
        """This grammar as onnxruntime-genai's guidance (``TurnOptions.set_guidance``) takes
        it: the same sources, and the same strict whitespace for JSON, as the host matcher.
        A grammar after reasoning has no such form: the model refuses it on og engines."""
        if self.kind == "json_schema":
            schema = closed_schema(self.source if isinstance(self.source, dict) else json.loads(self.source))
            return "json_schema", json.dumps(strict_whitespace(schema))
        return ("regex" if self.kind == "regex" else "lark_grammar"), str(self.source)


def strict_whitespace(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with llguidance's whitespace made strict unless its own ``x-guidance``
    says otherwise: without it the model may emit whitespace between tokens until
    max_tokens. An ``x-guidance`` that is not an object is a ``TypeError``."""
    given = schema.get("x-guidance", {})
    if not isinstance(given, dict):
        raise TypeError(f"x-guidance must be an object of llguidance's options, not {type(given).__name__}")
    return {**schema, "x-guidance": {"whitespace_flexible": False, **given}}


class Constraint:
    """One request's matcher: masks logits, follows the tokens actually chosen.

    The first mask is computed where the constraint is made (the request's worker thread),
    not at the engine's first step: it builds the grammar's lexer, which takes from
    milliseconds to seconds (40 tools with large enums: 0.37 s; a 36-byte pattern such as
    ``(((a{1000}){1000}){1000})``: 1.4-2 s and 250 MB), and in a step it held every other
    request of the model, whatever their key, behind it."""

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, first_mask: npt.NDArray[np.int32] | None = None
    ) -> None:
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self._matcher = matcher
        self._owned = first_mask is None
        """Whether the matcher is this constraint's own: a copy shares its original's (never
        advanced) until its first token."""
        self._vocab = vocab_size
        self._fill = fill_next_token_bitmask
        if first_mask is None:
            self._bitmask = allocate_token_bitmask(1, vocab_size)
            self._fill(matcher, self._bitmask)
            first_mask = self._bitmask.copy()
        else:
            self._bitmask = first_mask.copy()
        self._first_mask = first_mask
        """The first state's mask, never written: its copies share it."""
        self._filled = True
        """Whether the bitmask is the current state's (the first one, until a token comes)."""

    def copy(self) -> Constraint:
        """A constraint in this one's first state (this one must never advance), for
        another request or choice. It takes the first mask along (a pattern bomb's took
        0.2 s to fill, for each of a request's 16 prompts x 4 choices), and copies the
        matcher only at its first token, when the engine runs it: llguidance copies the
        lexer it has built (0.4 ms where building took 0.5 s; a bomb's is 5.5 MB, which
        64 copies made at once took +350 MiB)."""
        return Constraint(self._matcher, self._vocab, self._first_mask)

    def mask(self, logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """A copy of ``logits`` where every token the grammar forbids is -inf."""
        if not self._filled:
            self._fill(self._matcher, self._bitmask)
        self._filled = False
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def advance(self, token: int) -> bool:
        """Feed the chosen token; True once the grammar is complete (generation must end),
        or the matcher failed (then :attr:`error` says why)."""
        if not self._owned:
            self._matcher, self._owned = self._matcher.deep_copy(), True
        self._matcher.consume_token(token)
        self._filled = False
        return bool(self._matcher.is_stopped() or self._matcher.is_error())

    @property
    def error(self) -> str | None:
        """Why the matcher gave up, or ``None``."""
        # llguidance's first line; the rest is its parser state and the whole grammar
        return str(self._matcher.get_error()).strip().splitlines()[0] if self._matcher.is_error() else None


_KEPT_GRAMMARS = 8
"""Compiled grammars a model keeps, the most recently used: an agent sends the same tools
(and a client the same response format) with every request, and building a grammar's lexer
took 0.5 s for 40 tools with large enums; a kept one is copied in 0.4 ms."""
_KEPT_GROWTH = 32 * 2**20
"""A grammar is kept only if building it grew the process by less than this: the lexer of a
36-byte repetition pattern holds 250 MB, which eight kept ones would hold eight times."""


_SHARED: contextvars.ContextVar[dict[str, Constraint] | None] = contextvars.ContextVar(
    "ortserve_shared_grammars", default=None
)
"""Grammars compiled under :meth:`GrammarCompiler.sharing` on this thread, by their text."""


class GrammarCompiler:
    """Checks grammars against one model's tokenizer and makes matchers for them, keeping
    the last few compiled (:data:`_KEPT_GRAMMARS`) to copy for the next request asking."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer_json = tokenizer_json
        """Read at the first grammar: most models serve none, and reading SmolLM2's takes 13 ms."""
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._unusable: str | None = None
        """Why llguidance refused this model's tokenizer, once it has: a failed build is not
        tried again at every request (each try held the GIL 0.3 s for 49K tokens)."""
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[str, Constraint] = collections.OrderedDict()
        self.reused = 0
        """Constraints copied from a kept grammar (for tests and curiosity)."""
        self.threads = FairThreads(2, "grammar")
        """Two threads of this model's own to prepare requests with a grammar on, taking
        the callers (lanes) in turn: building a grammar can take seconds (a pattern bomb:
        2 s), and six such requests held every thread of the pool a server prepares all
        requests on."""

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        with self._lock:  # built on first use: about a second for a large vocabulary
            if self._tokenizer is None and self._unusable is None:
                try:
                    self._tokenizer = llguidance.LLTokenizer(
                        self._tokenizer_json.read_text(encoding="utf-8"), n_vocab=self._vocab_size, eos_token=self._eos
                    )
                except (OSError, UnicodeError, ValueError, TypeError) as error:
                    # e.g. "vocab size too small; 1024 vs 49152": the model's ONNX vocabulary
                    # is smaller than its tokenizer's (seventeenth and eighteenth probes).
                    self._unusable = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if self._tokenizer is None:
                raise InvalidRequestError(
                    f"this model cannot take grammars: llguidance refused its tokenizer ({self._unusable})",
                    param="grammar",
                )
            return self._tokenizer

    @contextlib.contextmanager
    def sharing(self) -> Iterator[None]:
        """Within it, on this thread, a grammar is built once and copied for every further
        constraint asking for it, however costly it was to build (and so not kept): one
        request's choices (``n``) and prompts. Eight choices built a pattern bomb's 170-250 MB
        lexer eight times (+1.4 GiB, 17-20 s)."""
        token = _SHARED.set({})
        try:
            yield
        finally:
            _SHARED.reset(token)

    def constraint(self, grammar: Grammar) -> Constraint:
        """A fresh matcher for ``grammar``; an invalid one raises :class:`InvalidRequestError`."""
        if grammar.beside is not None:
            field, other = grammar.beside
            try:
                self._constraint(other)  # kept as any compiled grammar is: the next turn's
            except InvalidRequestError as exc:
                raise InvalidRequestError(str(exc), param=field) from None
        try:
            return self._constraint(grammar)
        except InvalidRequestError as exc:
            if grammar.blame_unless is None or exc.param != "grammar":
                raise
            field, part, own = grammar.blame_unless
            self._constraint(part)  # its own error, if it has one
            try:
                self._constraint(own)
            except InvalidRequestError as alone:
                raise InvalidRequestError(str(alone), param=field) from None
            raise InvalidRequestError(str(exc), param=field) from None

    def _constraint(self, grammar: Grammar) -> Constraint:
        # llguidance's calls run on a large stack (its compiler recurses): see _large_stack.
        text = on_large_stack(lambda: _grammar_text(grammar))
        shared = _SHARED.get()
        if shared is not None and text in shared:
            return shared[text].copy()
        built = self._compiled(text, grammar)
        if shared is not None:
            shared[text] = built
        return built.copy()

    def _compiled(self, text: str, grammar: Grammar) -> Constraint:
        import llguidance

        with self._lock:
            kept = self._kept.get(text)
            if kept is not None:
                self._kept.move_to_end(text)
                self.reused += 1
                return kept.copy()
        tokenizer = self._llg_tokenizer()
        before = resident_memory()
        # Built once: a matcher of a grammar it refuses says why (what validate_grammar says,
        # which is a whole compile again: 34 ms more for a 9,000-value enum).
        matcher = on_large_stack(lambda: llguidance.LLMatcher(tokenizer, text))
        if matcher.is_error():
            raise _refused(grammar, matcher.get_error())
        constraint = on_large_stack(lambda: Constraint(matcher, self._vocab_size))
        # Other threads' growth counts too (kept less, never more); where there is no
        # resident size to read (not Linux) it reads 0 and every grammar is kept.
        if resident_memory() - before < _KEPT_GROWTH:
            with self._lock:
                self._kept[text] = constraint
                while len(self._kept) > _KEPT_GRAMMARS:
                    self._kept.popitem(last=False)
        return constraint


def _refused(grammar: Grammar, error: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid {grammar.kind.replace('_', ' ')}: {error.strip()}", param="grammar")


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames")


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that declares ``properties`` but does not say
    ``additionalProperties`` closed to them (``additionalProperties: false``).

    JSON Schema leaves objects open by default, and a small model then goes on adding
    keys (``{"a": 1, "b": 2, "c": 3, ...``) until max_tokens cuts it (measured on
    SmolLM2). Generated JSON holds what the schema declares, as vLLM's strict grammars
    and llama.cpp's schema converter do; ``additionalProperties: true`` (or a schema for
    them), or ``patternProperties``, keeps an object open. The members of an ``allOf``
    stay as given: closing each would refuse the properties the others declare.
    """
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = [closed_schema(item) for item in closed[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_schema(sub) for name, sub in closed[key].items()}
    for key in (*_SUBSCHEMAS, "additionalProperties"):
        if isinstance(closed.get(key), dict):
            closed[key] = closed_schema(closed[key])
    # Only objects that declare properties: {"type": "object"} alone (json_object, a tool
    # without parameters) means any object.
    if "properties" in closed and not {"additionalProperties", "patternProperties", "allOf"} & set(closed):
        closed["additionalProperties"] = False
    return closed


def _grammar_text(grammar: Grammar) -> str:
    import llguidance

    if grammar.after_reasoning is not None:
        # llguidance nests grammars: the think block, then the asked-for grammar by name.
        inner = _grammar_text(Grammar(grammar.kind, grammar.source))
        entry = json.loads(inner)["grammars"][0] if inner.lstrip().startswith("{") else {"lark_grammar": inner}
        entry = {key: value for key, value in entry.items() if value is not None and key != "name"}
        prefix = reasoning_prefix_lark(*grammar.after_reasoning)
        return json.dumps({"grammars": [{"lark_grammar": prefix}, {**entry, "name": "inner"}]})
    try:
        if grammar.kind == "json_schema":
            schema = grammar.source if isinstance(grammar.source, dict) else json.loads(grammar.source)
            if not isinstance(schema, dict):
                raise InvalidRequestError("a JSON schema must be an object", param="grammar")
            _check_depth(json_schema_depth(schema), "JSON schema's objects, arrays and $refs", MAX_SCHEMA_DEPTH)
            schema = strict_whitespace(closed_schema(schema))
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema))
        if grammar.kind == "regex":
            return str(llguidance.LLMatcher.grammar_from_regex(str(grammar.source)))
        _check_depth(lark_depth(str(grammar.source)), "Lark grammar's rule references", MAX_GRAMMAR_DEPTH)
        _check_depth(lark_json_depth(str(grammar.source)), "JSON schema's objects, arrays and $refs", MAX_SCHEMA_DEPTH)
        return str(llguidance.LLMatcher.grammar_from_lark(str(grammar.source)))
    except InvalidRequestError:
        raise
    except RecursionError:  # json.loads of a deeply nested schema text
        raise InvalidRequestError(
            f"invalid {grammar.kind.replace('_', ' ')}: nested too deeply", param="grammar"
        ) from None
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid {grammar.kind.replace('_', ' ')}: {exc}", param="grammar") from exc


def _check_depth(depth: int, what: str, limit: int) -> None:
    """Refuse a grammar whose references go deeper than the compiler's stack can follow."""
    if depth > limit:
        raise InvalidRequestError(f"the {what} go {depth} deep; at most {limit} can be compiled", param="grammar")
