"""The front of a generative model: tokenizer, chat template, tool-call format, grammars,
request validation and prompt preparation. It turns a call into a :class:`Request` and
hands it to its :class:`~ortserve_runtime.engines.Engine`; it never touches onnxruntime.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import itertools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from tokenizers import Tokenizer

from .._config import ModelConfig
from .._contract import Request
from .._drafts import Drafter
from .._errors import AdapterNotFoundError, ContextLengthError, EngineClosedError, InvalidRequestError, ModelLoadError
from .._folder import GenaiFolder
from .._text_bounds import TextLimit
from ._constraints import Constraint, Grammar, GrammarCompiler
from ._logprobs import TokenBytes
from ._media import Media, flatten_messages
from ._multimodal import MediaProcessor
from ._reasoning import ReasoningBudget, ReasoningMarkers, detect_reasoning, reasoning_start
from ._sampling import GenerationOptions, Sampler
from ._shield import MarkedText, SpecialTextShield
from ._stops import StopMatcher
from ._stream import GenerationStream, Prompt
from ._template import ChatTemplate, Message
from ._tools import ToolCallFormat, detect_tool_format, tools_as_text

if TYPE_CHECKING:
    from .._contract import Engine

__all__ = ["ChatModel"]


class ChatModel:
    """A generative model: text, or text with images/audio when it has a media processor.

    Use :meth:`generate` from asyncio code; call :meth:`close` when done. ``engine`` says
    what runs the requests (``engine.name``, ``engine.provider``, ``engine.capabilities``).
    """

    kind: Literal["generative"] = "generative"

    def __init__(
        self,
        name: str,
        folder: GenaiFolder,
        config: ModelConfig,
        engine: Engine,
        media: MediaProcessor | None = None,
    ) -> None:
        self.name = name
        """The model's name; ``MODEL:ADAPTER`` for a view :meth:`with_adapter` made."""
        self.engine_reason = f"engine {engine.name}"
        """Why it runs on ``engine`` (set by the registry's loader, which chose it)."""
        self.base_name = name
        self._adapter_keys: dict[str, str] = {name: name for name in config.adapters}
        """LoRA adapter names -> the engine's keys (a name added again gets a new key, so
        nothing the engine kept of the old adapter serves it); shared with the views."""
        self._added = 0
        self.adapter: str | None = None
        """The adapter this model generates through (see :meth:`with_adapter`); ``None``: the base."""
        self.folder = folder.path
        self.config = config
        self.engine = engine
        self._media = media
        self._fed_tokens = media.fed_tokens if media is not None else frozenset()
        self.modalities: frozenset[str] = media.modalities if media is not None else frozenset()
        """Inputs besides text: ``"image"``, ``"audio"``."""
        path = folder.path
        self.context_length = folder.context_length
        self.max_sequence_length = folder.max_sequence_length(config)
        try:
            eos = folder.model.get("eos_token_id", [])
            self.eos_token_ids = frozenset(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            self.vocab_size = int(folder.model["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{path / 'genai_config.json'} lacks a required field: {exc}", path=path) from exc
        tokenizer_path = folder.tokenizer_path
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise ModelLoadError(f"{tokenizer_path} is not a valid tokenizer: {exc}", path=tokenizer_path) from exc
        self._prompt_limit = TextLimit(self.tokenizer, self.max_sequence_length)
        try:
            self._shield = SpecialTextShield(
                self.tokenizer,
                Tokenizer.from_file(str(tokenizer_path)),  # from the file: a copy of the object took twice as long
                media.placeholder_text if media is not None else None,
            )
        except ValueError as exc:
            raise ModelLoadError(f"{tokenizer_path}: {exc}", path=tokenizer_path) from exc
        self.chat_template = ChatTemplate.from_folder(path, config.chat_template)
        self.tool_format: ToolCallFormat | None = detect_tool_format(
            self.chat_template.source if self.chat_template else None
        )
        """How this model writes tool calls (from its chat template), or None."""
        self.tools_in_system_prompt = (
            self.tool_format is None and self.chat_template is not None and config.tools_in_system_prompt
        )
        """Its template knows no tools: they go into the system prompt (:func:`tools_as_text`)
        and calls are parsed in the ``hermes`` format."""
        if self.tools_in_system_prompt:
            self.tool_format = "hermes"
        self.reasoning: ReasoningMarkers | None = detect_reasoning(
            self.chat_template.source if self.chat_template else None
        )
        """The think markers of a reasoning model (from its chat template), or None."""
        self.grammars = GrammarCompiler(tokenizer_path, self.vocab_size, self.eos_token_ids)
        self._token_bytes: TokenBytes | None = None

    @property
    def failed(self) -> str | None:
        """Why the model cannot serve any more and must be loaded again (its engine's
        process ended), or ``None``."""
        failed: str | None = getattr(self.engine, "failed", None)
        return failed

    @property
    def process_resident_bytes(self) -> int:
        """The resident memory of the process the engine runs og in (0: this process)."""
        size: int = getattr(self.engine, "process_resident_bytes", 0)
        return size

    @property
    def token_bytes(self) -> TokenBytes:
        """Token id -> text and bytes, for log-probabilities (made on first use: it reads
        the whole tokenizer once, which most requests never need)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        return self._token_bytes

    @property
    def queued(self) -> int:
        """Requests waiting to start."""
        return self.engine.queued

    @property
    def active(self) -> int:
        """Requests being generated now."""
        return self.engine.active

    async def close(self) -> None:
        """Finish: pending requests get :class:`EngineClosedError`; the engine's thread exits."""
        await self.engine.close()
        if self._media is not None:
            self._media.preparing.shutdown(wait=False, cancel_futures=True)

    # -- public API (any thread / asyncio) -------------------------------------------------

    def with_adapter(self, adapter: str | None) -> ChatModel:
        """This model generating through LoRA adapter ``adapter`` (``None``: the base model).

        A view sharing everything with this model (engine, tokenizer, template), named
        ``MODEL:ADAPTER``; close the model itself, not a view. An adapter the model was not
        loaded with raises :class:`AdapterNotFoundError`.
        """
        if adapter == self.adapter:
            return self
        if adapter is not None and adapter not in self._adapter_keys:
            raise AdapterNotFoundError(self.base_name, adapter, self.adapters)
        view = copy.copy(self)
        view.adapter = adapter
        view.name = self.base_name if adapter is None else f"{self.base_name}:{adapter}"
        return view

    @property
    def adapters(self) -> tuple[str, ...]:
        """The LoRA adapters requests can use now, by name."""
        return tuple(self._adapter_keys)

    def add_adapter(self, name: str, path: Path) -> None:
        """Serve LoRA adapter ``name`` from ``path`` (checked against the model by the
        caller) from now on; blocking (og loads it between steps), so call it off the event
        loop. Engines without adapters per request raise ``ValueError``."""
        add = getattr(self.engine, "add_adapter", None)
        if add is None:
            raise ValueError(
                f"model {self.base_name!r} runs on {self.engine.name}, which takes no LoRA adapter per request "
                "(serve it with engine og-generator or ort-cpu)"
            )
        if name in self._adapter_keys:
            raise ValueError(f"model {self.base_name!r} already has a LoRA adapter {name!r}")
        self._added += 1
        key = f"{name}@{self._added}"
        add(key, path)
        self._adapter_keys[name] = key

    def remove_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter ``name``: new requests naming it are refused at once,
        requests already running finish with it."""
        key = self._adapter_keys.pop(name, None)
        if key is None:
            raise AdapterNotFoundError(self.base_name, name, self.adapters)
        self.engine.retire_adapter(key)  # type: ignore[attr-defined]  # engines that took it have it

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets other threads run meanwhile; encode held the GIL (a 4 MB prompt:
        # /health 3.7 s; seventeenth probe, issue 45).
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    @property
    def max_prompt_chars(self) -> int:
        """Characters a prompt may have before it is tokenized (its tokens are checked after;
        see :class:`TextLimit`; its first use scans the vocabulary: call it off the event loop)."""
        return self._prompt_limit.chars()

    def check_prompt_size(self, text: str, param: str = "prompt", *, spelt: int = 0, limit: int | None = None) -> None:
        """Refuse ``text`` with :class:`ContextLengthError` when it has more tokens than the
        context holds (or ``limit``, where a text is not generated from: ``/v1/tokenize``),
        found without building them all (:meth:`TextLimit.past`): a text with more
        characters than that many tokens can spell is refused untokenized. ``spelt``: how
        many special tokens the caller spelt in it (each is tokenized again as text, which
        can join the text beside it: two tokens fewer at most, allowed for)."""
        what = {
            "messages": "the prompt the chat template made of the messages and tools",
            "prediction": "prediction (the predicted output)",
        }.get(param, "the prompt")
        tokens = limit or self.max_sequence_length
        whose = "this model's limit" if tokens == self.max_sequence_length else "the limit"
        # Every token spans a character at least: a text this short needs no vocabulary scan.
        if len(text) > 3 * tokens and len(text) > self.max_prompt_chars * tokens // self.max_sequence_length:
            raise ContextLengthError(
                f"{what} has {len(text)} characters, more than {whose} of {tokens} tokens could hold",
                param=param,
            )
        found = self._prompt_limit.past(text, tokens + 2 * spelt)
        if found is not None:
            raise ContextLengthError(
                f"{what} has at least {found} tokens, more than {whose} of {tokens} tokens", param=param
            )

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="tokens"
            )
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the model's own template makes of ``messages`` (and ``tools``).

        Content may be a list of parts (text, :class:`ImageInput`, :class:`AudioInput`);
        media parts appear as the model's placeholders. ``template_kwargs`` are more
        template variables (``enable_thinking``, ``reasoning_effort``...).
        """
        return self._render(messages, tools, add_generation_prompt, template_kwargs)[0].text

    def prepare_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """The prompt for ``messages``, ready for :meth:`generate` (``n`` choices may share it);
        ``list(prompt)`` gives its token ids (images as the negative ids of their features);
        ``prompt.reasoning`` says whether a reasoning model's output starts in its thinking.

        For multimodal models this decodes the media and runs the processor: call it from a
        worker thread in asyncio code (:meth:`aprepare_chat`).
        """
        marked, media = self._render(messages, tools, add_generation_prompt, template_kwargs)
        prompt = self._prepare(marked, media)
        start = reasoning_start(self.reasoning, marked.text) if add_generation_prompt else None
        return dataclasses.replace(prompt, reasoning=start) if start is not None else prompt

    async def aprepare_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> Prompt:
        """:meth:`prepare_chat` in a worker thread: rendering the template, tokenizing and
        decoding media take long enough for a large request to stall the event loop. A
        multimodal model's requests wait for its own threads (its media processor's), not
        the shared pool's."""
        prepare = functools.partial(
            self.prepare_chat,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )
        if self._media is not None:
            return await asyncio.get_running_loop().run_in_executor(self._media.preparing, prepare)
        return await asyncio.to_thread(prepare)

    def generate(
        self,
        prompt: str | Sequence[int] | Prompt | None = None,
        *,
        messages: Sequence[Message] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        options: GenerationOptions | None = None,
    ) -> GenerationStream:
        """Start a generation from text, token ids, a prepared prompt, or chat messages.

        Everything is validated here, before anything reaches the engine: bad options,
        an empty prompt, token ids outside the vocabulary and prompts that do not fit the
        context raise :class:`InvalidRequestError` (or :class:`ContextLengthError`).

        Tokenizing and compiling a grammar take time in proportion to their size: from
        asyncio code, call it in a worker thread (``asyncio.to_thread``), as the server
        does; the stream is then read from the event loop as usual (it reaches the engine
        on its first read).
        """
        options = options or GenerationOptions()
        options.validate()
        if self.engine.closing:
            raise EngineClosedError(f"model {self.name!r} is closed")
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give either a prompt or messages", param="prompt")
        if messages is not None:
            prompt = self.prepare_chat(messages, tools=tools)
        elif isinstance(prompt, str):
            self.check_prompt_size(prompt)
            prompt = Prompt(self.encode(prompt))
        elif not isinstance(prompt, Prompt):
            ids = [int(t) for t in prompt or ()]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
            media = [t for t in ids if t in self._fed_tokens]
            if media:
                raise InvalidRequestError(
                    f"token id {media[0]} is where model {self.name!r}'s processor puts an image or audio: "
                    "a prompt of token ids carries no media (send them in messages)",
                    param="prompt",
                )
            prompt = Prompt(ids)
        field_name = "messages" if messages is not None else "prompt"
        if not prompt.ids:
            raise InvalidRequestError("the prompt is empty", param=field_name)
        room = self.max_sequence_length - len(prompt.ids)
        least = 0 if options.max_tokens == 0 else 1  # 0: the prompt alone, scored (prompt_logprobs)
        if room < least or (options.max_tokens is not None and options.max_tokens > room):
            asked = f" plus max_tokens {options.max_tokens}" if options.max_tokens is not None else ""
            raise ContextLengthError(
                f"the prompt has {len(prompt.ids)} tokens{asked}, more than this model's limit of "
                f"{self.max_sequence_length} tokens",
                param="max_tokens" if room >= least else field_name,
            )
        grammar = options.grammar
        if grammar is not None and prompt.reasoning is not None and self.reasoning is not None:
            # The constraint holds for the answer; the reasoning before it stays free.
            grammar = dataclasses.replace(grammar, after_reasoning=(self.reasoning, prompt.reasoning))
        self._check_engine(prompt, options, grammar)
        grammar_constraint = self.grammars.constraint(grammar) if grammar is not None else None
        constraint: Constraint | ReasoningBudget | None = grammar_constraint
        if options.reasoning_budget is not None and prompt.reasoning is not None and self.reasoning is not None:
            constraint = ReasoningBudget(
                options.reasoning_budget,
                self.reasoning,
                prompt.reasoning,
                self.encode(self.reasoning.end, add_special_tokens=False),
                self.tokenizer,
                grammar_constraint,
            )
        drafter = None
        if self.engine.capabilities.drafts and (options.prediction or self.config.speculative is not None):
            predicted = None
            if options.prediction:
                # Drafts for the output, which the context bounds: a longer one has no use.
                self.check_prompt_size(options.prediction, "prediction")
                predicted = self.encode(options.prediction, add_special_tokens=False)
                if len(predicted) > self.max_sequence_length:
                    raise ContextLengthError(
                        f"prediction (the predicted output) has {len(predicted)} tokens, more than this model's "
                        f"limit of {self.max_sequence_length} tokens",
                        param="prediction",
                    )
            drafter = Drafter(prompt.ids, predicted, lookup=self.config.speculative == "ngram")
        request = Request(
            prompt=list(prompt.ids),
            media=prompt.media,
            constraint=constraint,
            max_tokens=options.max_tokens if options.max_tokens is not None else room,
            options=options,
            sampler=Sampler(options, self.eos_token_ids),
            stops=StopMatcher(options.stop),
            tokenizer=self.tokenizer,
            eos=self.eos_token_ids,
            token_bytes=self.token_bytes
            if options.logprobs is not None or options.prompt_logprobs is not None
            else None,
            adapter=self._adapter_key(),
            drafter=drafter,
            prompt_scores=[None] * len(prompt.ids) if options.prompt_logprobs is not None else None,
        )
        return GenerationStream(self.engine, request)

    def _adapter_key(self) -> str | None:
        if self.adapter is None:
            return None
        key = self._adapter_keys.get(self.adapter)
        if key is None:  # unloaded since this view was made
            raise AdapterNotFoundError(self.base_name, self.adapter, self.adapters)
        return key

    def _check_engine(self, prompt: Prompt, options: GenerationOptions, grammar: Grammar | None) -> None:
        """Refuse what this engine cannot honour, naming the field, rather than ignore it."""
        capabilities = self.engine.capabilities
        if options.prompt_logprobs is not None and not capabilities.prompt_logprobs:
            raise InvalidRequestError(
                f"prompt_logprobs: model {self.name!r} runs on the {self.engine.name} engine, which cannot score a "
                "prompt's tokens (it hands back the last position's logits only); serve the model with "
                "--engine ort-cpu (CPU)",
                param="prompt_logprobs",
            )
        if options.reasoning_budget is not None and prompt.reasoning is not None and not capabilities.host_sampling:
            raise InvalidRequestError(
                f"model {self.name!r} runs on the {self.engine.name} engine, which samples inside "
                "onnxruntime-genai and cannot end its thinking after a budget of tokens; serve the model with "
                "--engine og-generator (or ort-cpu on the CPU)",
                param="reasoning_budget",
            )
        if grammar is not None and grammar.after_reasoning is not None and not capabilities.host_sampling:
            # og takes a grammar for the whole output: it would stop the model thinking.
            raise InvalidRequestError(
                f"model {self.name!r} reasons before it answers, and its {self.engine.name} engine constrains the "
                "whole output inside onnxruntime-genai; turn thinking off (chat_template_kwargs "
                '{"enable_thinking": false}), or serve the model with --engine og-generator (or ort-cpu on the CPU)',
                param="grammar",
            )
        bad = [t for t in options.logit_bias if t >= self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="logit_bias"
            )
        media = [t for t in options.logit_bias if t in self._fed_tokens]
        if media:  # never sampled (see MediaProcessor.fed_tokens): a bias on it would do nothing
            raise InvalidRequestError(
                f"logit_bias: token id {media[0]} is model {self.name!r}'s image or audio token, which it never "
                "generates",
                param="logit_bias",
            )
        if not capabilities.host_sampling:
            # og samples inside onnxruntime-genai: its TurnOptions take temperature, top-k/p
            # and the repetition penalty only, and no logits come back to score.
            asked = [
                ("logprobs", options.logprobs is not None),
                ("logit_bias", bool(options.logit_bias)),
                ("min_p", options.min_p != 0.0),
                ("presence_penalty", options.presence_penalty != 0.0),
                ("frequency_penalty", options.frequency_penalty != 0.0),
            ]
            for name, wanted in asked:
                if wanted:
                    raise InvalidRequestError(
                        f"{name}: model {self.name!r} runs on the {self.engine.name} engine, which samples inside "
                        "onnxruntime-genai and cannot do this; serve the model with --engine og-generator "
                        "(or ort-cpu on the CPU)",
                        param=name,
                    )
        if options.cache_salt is not None and not capabilities.salted_cache:
            raise InvalidRequestError(
                f"cache_salt: model {self.name!r} runs on the {self.engine.name} engine, whose prefix reuse inside "
                "onnxruntime-genai takes no salt; serve the model with --engine og-generator to keep requests apart",
                param="cache_salt",
            )
        if options.prediction and not capabilities.drafts:
            raise InvalidRequestError(
                f"prediction: model {self.name!r} runs on the {self.engine.name} engine, which takes no draft tokens "
                "from a request; leave prediction out, or serve the model with --engine ort-cpu",
                param="prediction",
            )
        if options.seed is not None and not options.greedy and not capabilities.seeds:
            raise InvalidRequestError(
                f"seed: model {self.name!r} runs on the {self.engine.name} engine with {capabilities.batching} "
                f"batching on {self.engine.provider}, which cannot reseed per request; leave seed out, or serve the "
                "model with --engine og-generator (or ort-cpu on the CPU)",
                param="seed",
            )
        if prompt.media is not None and not capabilities.media:
            raise InvalidRequestError(
                f"model {self.name!r} runs on the {self.engine.name} engine, which takes no images or audio",
                param="messages",
            )

    # -- prompts -----------------------------------------------------------------------------

    def _render(
        self,
        messages: Sequence[Message],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> tuple[MarkedText, Media]:
        """The rendered prompt, with the special tokens the caller's text spells marked
        (:mod:`._shield`), and its media."""
        if self.chat_template is None:
            raise InvalidRequestError(f"model {self.name!r} has no chat template; use completions", param="messages")
        # Text parts are joined before marking: "<|im_" and "start|>" make one token together.
        limit = self.max_sequence_length
        messages = _joined_text_parts(messages)
        if self._media is not None:  # named where it is (the shield's own refusal, below, cannot)
            _refuse_typed_placeholders(messages, self._media.placeholder_text, self.name)
        messages, _ = self._shield.mark(messages, "messages", limit)
        tools, _ = self._shield.mark(tools, "tools", limit)
        template_kwargs, _ = self._shield.mark(template_kwargs, "chat_template_kwargs", limit)
        placeholders = self._media.placeholders if self._media is not None else {}
        flat, media = flatten_messages(messages, placeholders, self.name)
        if self.tools_in_system_prompt:
            flat, tools = tools_as_text(flat, tools), None
        text = self.chat_template.render(
            flat, tools=tools, add_generation_prompt=add_generation_prompt, extra=template_kwargs
        )
        marked = self._shield.read(text)
        if marked.spans and self._media is not None:
            # og's processor tokenizes the whole text itself, with special tokens matched
            # (text the template does not write, as a variable it never reads, is no matter).
            raise InvalidRequestError(
                f"the request's text spells one of model {self.name!r}'s special tokens (such as its turn "
                "markers) or media placeholders; its multimodal processor would read it as that token, not as text",
                param="messages",
            )
        return marked, media

    def _prepare(self, marked: MarkedText, media: Media) -> Prompt:
        """The prompt of a rendered chat: its tokens, or the media processor's inputs."""
        self.check_prompt_size(marked.text, "messages", spelt=len(marked.spans))
        if self._media is not None:
            return self._media.prepare(marked.text, media)
        return Prompt(self._shield.encode(marked))


def _joined_text_parts(messages: Sequence[Message]) -> list[Message]:
    """``messages`` with each run of text parts in a content list joined into one."""
    joined: list[Message] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(
            isinstance(a, str) and isinstance(b, str) for a, b in itertools.pairwise(content)
        ):
            joined.append(message)
            continue
        parts: list[Any] = []
        for is_text, run in itertools.groupby(content, key=lambda part: isinstance(part, str)):
            # One join a run: adding each part to the last was quadratic (20,000 parts of a
            # 14 MB chat: 56 s; fifteenth probe, issue 45).
            items = list(run)
            parts += ["".join(items)] if is_text else items
        joined.append({**message, "content": parts})
    return joined


def _refuse_typed_placeholders(messages: Sequence[Message], placeholders: re.Pattern[str], model: str) -> None:
    """A 400 for message text that spells one of a multimodal model's media placeholders:
    its processor took a typed ``<|image_1|>`` for the request's first image, which the
    model then saw twice (fifteenth probe of issue 45)."""
    for index, message in enumerate(messages):
        content = message.get("content")
        texts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
        for text in texts:
            found = placeholders.search(text) if isinstance(text, str) else None
            if found is not None:
                raise InvalidRequestError(
                    f"messages[{index}].content holds {found.group()!r}, which model {model!r} reads as a place "
                    "for an image or audio, not as text: send media as content parts",
                    param=f"messages[{index}].content",
                )
