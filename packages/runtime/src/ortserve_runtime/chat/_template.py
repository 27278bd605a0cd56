"""Chat formatting through the model's own Jinja chat template.

The template comes from the model folder (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``), or from a file the operator names instead
(``ModelConfig.chat_template``), and renders in a sandboxed Jinja environment with the helpers
Hugging Face templates expect (``raise_exception``, ``tojson``, ``strftime_now``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .._errors import InvalidRequestError, ModelLoadError

__all__ = ["ChatTemplate", "Message"]

_RANGE_STEPS = 1_000_000
"""The steps every ``range()`` of one rendering may make together. The sandbox bounds each
range to 100,000 but not a range inside a loop: two nested ones made a template that
rendered for ever (a request thread spinning, the request never answered). Templates loop
over the messages and tools; their ranges count a few of those."""

Message = Mapping[str, Any]
"""One chat message as plain data: ``{"role": ..., "content": ...}`` plus optional
``tool_calls``, ``tool_call_id`` and ``name``, exactly as the template expects them."""


def _raise_exception(message: str) -> None:
    raise InvalidRequestError(f"the chat template rejected the messages: {message}", param="messages")


def _bounded_range() -> Callable[..., range]:
    """``range`` for one rendering: the sandbox's (100,000 steps each), with
    :data:`_RANGE_STEPS` in all."""
    left = _RANGE_STEPS

    def bounded(*args: int) -> range:
        nonlocal left
        steps = jinja2.sandbox.safe_range(*args)
        left -= len(steps)
        if left < 0:
            raise jinja2.exceptions.SecurityError(f"its ranges make more than {_RANGE_STEPS} steps in all")
        return steps

    return bounded


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template plus the special tokens it may refer to."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
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
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"{config_path} is not valid JSON: {exc}", path=config_path) from exc
        source: Any = None
        jinja_path = folder / "chat_template.jinja"
        if override is not None:
            try:
                source = override.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ModelLoadError(f"the chat template {override} could not be read: {exc}", path=override) from exc
            if not source.strip():
                raise ModelLoadError(f"the chat template {override} is empty", path=override)
        elif jinja_path.exists():
            source = jinja_path.read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
            if isinstance(source, list):  # named templates: take "default"
                named = {item.get("name"): item.get("template") for item in source if isinstance(item, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
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
        try:
            variables = dict(extra or {})
            # Set last, so that no extra variable can stand in for them.
            variables.update(
                messages=[dict(m) for m in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                range=_bounded_range(),
                **self._special_tokens,
            )
            return self._template.render(variables)
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


def _token_text(value: Any) -> str | None:
    """Special tokens appear in tokenizer_config.json as text or as AddedToken dicts."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None
