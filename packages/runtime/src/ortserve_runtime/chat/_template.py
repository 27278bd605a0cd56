"""Chat formatting through the model's own Jinja chat template.

The template comes from the model folder (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``), or from a file the operator names instead
(``ModelConfig.chat_template``), and renders in a sandboxed Jinja environment with the helpers
Hugging Face templates expect (``raise_exception``, ``tojson``, ``strftime_now``).
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .._errors import InvalidRequestError, ModelLoadError
from .._model_files import MAX_SETTINGS_BYTES, checked_file, read_json_file

__all__ = ["ChatTemplate", "Message"]

_RENDER_STEPS = 1_000_000
"""The steps one rendering may make: every pass of a ``for`` loop (over anything: a range,
the messages, a copy of them, a recursive ``loop()``) and every call. The sandbox bounds each
range to 100,000 but not a loop inside a loop: two nested ranges (or loops over the messages
inside loops over the messages) made a template that rendered for ever (a request thread
spinning, the request never answered). Templates loop over the messages and tools a few times."""

_RENDER_SECONDS = 10.0
"""The longest one rendering may take: a step can still be slow (``in`` between two
megabyte strings), and steps times such steps is more than a request may cost. Real
templates render in milliseconds."""

_MAX_MADE_CHARS = 1_000_000
"""The longest value a template may make by repeating, padding or joining (``'x' * n``,
``+``, ``~``, ``join``, ``center``, ``indent``, ``%``/``format`` widths; what ``replace``
adds): ``center(2e9)`` made a 2 GB string. Templates pad by a few spaces; their text comes
from the messages."""

_MAX_RENDERED_CHARS = 64 * 1024 * 1024
"""The longest text one rendering may write: a loop writing a megabyte value a million
times made a terabyte. Past a model's context in any case (its prompt is refused after
rendering when longer than it could hold); this bounds what a rendering costs before that."""

_MAX_TEMPLATE_CHARS = 1_048_576
"""The longest chat template a model may have. Compiling takes time in proportion to the
source (a 22 MB one took 128 s, a GGUF file can carry any); published templates are a few
KB to some 60 KB, so a megabyte leaves them room and bounds a load to seconds."""

Message = Mapping[str, Any]
"""One chat message as plain data: ``{"role": ..., "content": ...}`` plus optional
``tool_calls``, ``tool_call_id`` and ``name``, exactly as the template expects them."""


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"the chat template rejected the messages: {message}", param="messages")


class _Budget:
    """One rendering's steps and time (:data:`_RENDER_STEPS`, :data:`_RENDER_SECONDS`)."""

    __slots__ = ("deadline", "left")

    def __init__(self) -> None:
        self.left = _RENDER_STEPS
        self.deadline = time.monotonic() + _RENDER_SECONDS

    def spend(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            raise jinja2.exceptions.SecurityError(f"its loops and calls make more than {_RENDER_STEPS} steps in all")
        if time.monotonic() > self.deadline:
            raise jinja2.exceptions.SecurityError(f"it renders for more than {_RENDER_SECONDS:g} s")

    def counted(self, items: Iterable[Any]) -> Iterator[Any]:
        for item in items:
            self.spend(1)
            yield item


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")
"""The budget of the rendering under way on this thread (renderings run on worker threads)."""


def _made(size: int, what: str) -> None:
    if size > _MAX_MADE_CHARS:
        raise jinja2.exceptions.SecurityError(
            f"its {what} makes a value of {size:,} items; at most {_MAX_MADE_CHARS:,}"
        )


_PERCENT = re.compile(r"%(\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.?)", re.DOTALL)
"""One ``%`` conversion: its mapping key, width, precision and type."""

_FORMAT_WIDTHS = re.compile(r"\{[^{}]*?:[^{}]*?(\d+)")
"""Widths and precisions in ``str.format`` specifications."""


def _replace_growth(text: str, old: str, new: str) -> int:
    """How many characters ``text.replace(old, new)`` adds."""
    return (text.count(old) if old else len(text) + 1) * (len(new) - len(old))


def _check_widths(spec: Any, what: str, args: Any = ()) -> None:
    """Refuse a ``%`` or ``str.format`` specification whose widths or precisions make a
    value past :data:`_MAX_MADE_CHARS`; a ``*`` width takes its number from ``args`` (the
    right side of ``%``), in order, as Python does."""
    if not isinstance(spec, str):
        return
    for match in _FORMAT_WIDTHS.finditer(spec):
        _made(int(match.group(1)), what)
    values = args if isinstance(args, tuple) else (args,)
    position = 0
    for match in _PERCENT.finditer(spec):
        key, width, precision, kind = match.groups()
        for number in (width, precision):
            if number == "*":
                star = values[position] if position < len(values) else 0
                position += 1
                if isinstance(star, int):
                    _made(abs(star), what)
            elif number:
                _made(int(number), what)
        if kind != "%" and key is None:
            position += 1


def _join_size(items: Any, separator: Any) -> int:
    if not isinstance(items, list | tuple):
        return 0  # an iterator: its items are made one at a time, each one bounded
    return sum(len(item) for item in items if isinstance(item, str)) + len(str(separator)) * len(items)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with the ways one expression could make a huge value bounded
    (:data:`_MAX_MADE_CHARS`): repetition, powers, widths in ``%`` and ``format``, and
    the string methods and filters that pad."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        """The parsed template with every ``for`` loop's items counted (:meth:`counted`) and
        every ``~`` bounded (:meth:`bounded_concat`): neither passes through a sandbox hook."""
        template = super()._parse(source, name, filename)
        for loop in template.find_all(nodes.For):
            loop.iter = nodes.Call(
                nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None, lineno=loop.iter.lineno
            )
        for concat in template.find_all(nodes.Concat):
            concat.nodes = [
                nodes.Call(
                    nodes.EnvironmentAttribute("bounded_concat"), concat.nodes, [], None, None, lineno=concat.lineno
                )
            ]
        return template

    @staticmethod
    def counted(items: Any) -> Any:
        return _BUDGET.get().counted(items)

    @staticmethod
    def bounded_concat(*parts: Any) -> str:  # not "concat": Jinja's own name for "".join
        texts = [str(part) for part in parts]
        _made(sum(map(len, texts)), "'~'")
        return "".join(texts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                _made(len(left) + len(right), "'+'")
        elif operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(times, int):
                    _made(len(seq) * times, "'*'")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            _made(int(right * math.log10(abs(left))), "'**' (digits)")
        elif operator == "%":
            _check_widths(left, "'%'", right)
        return super().call_binop(context, operator, left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _BUDGET.get().spend(1)  # a macro calling itself, a recursive loop() or any call
        if isinstance(obj, LoopContext) and args:  # loop(children) in a recursive loop: count its items too
            args = (self.counted(args[0]), *args[1:])
        owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
        if isinstance(owner, str):
            if name in ("center", "ljust", "rjust", "zfill") and args and isinstance(args[0], int):
                _made(args[0], f"str.{name}")
            elif name == "expandtabs":
                _made(owner.count("\t") * int(args[0] if args else kwargs.get("tabsize", 8)), "str.expandtabs")
            elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
                _made(_replace_growth(owner, args[0], args[1]), "str.replace")
        elif name in ("format", "format_map"):  # the sandbox's wrapper of a string's own method
            _check_widths(getattr(getattr(obj, "__wrapped__", None), "__self__", None), f"str.{name}")
        return super().call(context, obj, *args, **kwargs)


def _bounded_filters(env: _Sandbox) -> None:
    """The padding filters, bounded as the string methods are (filters do not pass
    through the sandbox's ``call``)."""
    center, indent, replace, fmt, join = (env.filters[n] for n in ("center", "indent", "replace", "format", "join"))

    def bounded_center(value: Any, width: int = 80) -> str:
        _made(int(width), "center")
        return str(center(value, width))

    def bounded_indent(value: Any, width: int | str = 4, *args: Any, **kwargs: Any) -> Any:
        pad = len(width) if isinstance(width, str) else int(width)
        _made(pad * (str(value).count("\n") + 1), "indent")
        return indent(value, width, *args, **kwargs)

    @jinja2.pass_eval_context  # as the filters they wrap
    def bounded_replace(context: Any, value: Any, old: Any, new: Any, count: int | None = None) -> Any:
        _made(_replace_growth(str(value), str(old), str(new)), "replace")
        return replace(context, value, old, new, count)

    def bounded_format(value: Any, *args: Any, **kwargs: Any) -> str:
        _check_widths(value, "format")
        return str(fmt(value, *args, **kwargs))

    @jinja2.pass_eval_context
    def bounded_join(context: Any, value: Any, d: Any = "", attribute: Any = None) -> Any:
        if attribute is None:
            _made(_join_size(value, d), "join")
        return join(context, value, d, attribute)

    env.filters.update(
        center=bounded_center, indent=bounded_indent, replace=bounded_replace, format=bounded_format, join=bounded_join
    )


_NON_ASCII_BUT_MARKS = re.compile("[^\x00-\x7f\ufdd0\ufdd1]")
"""What ``ensure_ascii`` escapes, less the marks around caller-spelt special tokens
(:mod:`._shield`): escaped, they would be lost and the token inside matched again."""


def _escape_non_ascii(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code < 0x10000:
        return f"\\u{code:04x}"
    code -= 0x10000
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    text = json.dumps(value, indent=indent, ensure_ascii=False, sort_keys=sort_keys)
    # Outside strings JSON is ASCII: escaping what is left matches json's own ensure_ascii.
    return _NON_ASCII_BUT_MARKS.sub(_escape_non_ascii, text) if ensure_ascii else text


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None]) -> None:
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
        _bounded_filters(env)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self._template = env.from_string(source)
        self._special_tokens = dict(special_tokens)

    @classmethod
    def from_folder(cls, folder: Path, override: Path | None = None) -> ChatTemplate | None:
        """The folder's template (or the ``override`` file's, with the folder's special
        tokens), or ``None`` when it has none (completions still work)."""
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.exists():
            found = read_json_file(config_path)
            config = found if isinstance(found, dict) else {}
        source: Any = None
        jinja_path = folder / "chat_template.jinja"
        if override is not None:
            try:
                source = checked_file(override, MAX_SETTINGS_BYTES).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"the chat template {override} could not be read: {exc}", path=override) from exc
            if not source.strip():
                raise ModelLoadError(f"the chat template {override} is empty", path=override)
        elif jinja_path.exists():
            source = checked_file(jinja_path, MAX_SETTINGS_BYTES).read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates: take "default"
                named = {item.get("name"): item.get("template") for item in source if isinstance(item, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        if len(source) > _MAX_TEMPLATE_CHARS:
            what = f"the chat template {override}" if override else f"the chat template of {folder}"
            raise ModelLoadError(
                f"{what} is {len(source):,} characters; a template may have at most {_MAX_TEMPLATE_CHARS:,}",
                path=override or folder,
            )
        special = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        try:
            return cls(source, special_tokens=special)
        except jinja2.TemplateError as exc:
            where = override or folder
            line = f" (line {exc.lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) and exc.lineno else ""
            what = f"the chat template {override}" if override else f"the chat template of {folder}"
            raise ModelLoadError(f"{what} does not compile{line}: {exc}", path=where) from exc

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for ``messages``; template errors become :class:`InvalidRequestError`.

        ``extra``: more template variables (``enable_thinking``, ``reasoning_effort``...);
        they never replace the messages, tools, generation prompt or special tokens."""
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        kept = {"messages", "tools", "add_generation_prompt", *self._special_tokens}
        clash = sorted(kept.intersection(extra or {}))
        if clash:  # dropped without a word before (sixteenth probe)
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {clash[0]!r}: the request's own fields set it",
                param="chat_template_kwargs",
            )
        budget = _BUDGET.set(_Budget())
        try:
            variables = dict(extra or {})
            # Set last, so that no extra variable can stand in for them.
            variables.update(
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
            return self._write(variables)
        except InvalidRequestError:
            raise
        # What a template's own expressions raise: a range past the sandbox's bound is an
        # OverflowError, a macro that calls itself a RecursionError (both were a bare 500).
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            LookupError,
            AttributeError,
            ArithmeticError,
            RecursionError,
        ) as exc:
            raise InvalidRequestError(
                f"the chat template could not render the messages: {exc}", param="messages"
            ) from exc
        finally:
            _BUDGET.reset(budget)

    def _write(self, variables: dict[str, Any]) -> str:
        """The rendered text, refused past :data:`_MAX_RENDERED_CHARS` as it is written."""
        pieces, written = [], 0
        for piece in self._template.generate(variables):
            written += len(piece)
            if written > _MAX_RENDERED_CHARS:
                raise jinja2.exceptions.SecurityError(f"it writes more than {_MAX_RENDERED_CHARS:,} characters")
            pieces.append(piece)
        return "".join(pieces)


def _token_text(value: Any) -> str | None:
    """Special tokens appear in tokenizer_config.json as text or as AddedToken dicts."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None
