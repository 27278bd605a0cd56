"""Generative models: continuous batching over an onnxruntime-genai model folder.

Why not ``og.Engine`` or a batched ``og.Generator`` on the CPU (measured with
onnxruntime-genai 0.18, see README): the static Engine batches at most 4 requests and a
new request waits for the whole batch; a batched Generator takes every prompt at once and
its left padding gives wrong results for the padded rows of GQA models. So the decoder ONNX
graph the genai builder writes is driven directly with onnxruntime:

* one owner thread per model runs every session call; asyncio callers never block;
* each request owns one row of a key/value cache shared between past and present
  (GroupQueryAttention's share-buffer mode, as onnxruntime-genai does it), so a request
  joins the running batch after its own prefill and leaves it the step it finishes or is
  cancelled, freeing its row at once (continuous batching);
* sampling, stop strings and EOS handling run per request on the host, so requests with
  different options share one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import mmap
import threading
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import onnx
import onnx.helper
import onnx.numpy_helper
import onnxruntime as ort
from tokenizers import Tokenizer, decoders

from ._chat import ChatTemplate, Message
from ._config import ModelConfig
from ._constraints import Constraint, GrammarCompiler
from ._errors import ContextLengthError, EngineClosedError, EngineError, InvalidRequestError, ModelLoadError
from ._media import Media, Placeholders, flatten_messages
from ._sampling import GenerationOptions, Sampler
from ._stops import StopMatcher
from ._tools import ToolCallFormat, detect_tool_format

__all__ = ["ChatModel", "FinishReason", "GenerationEvent", "GenerationStream", "GenerativeModel", "Prompt", "Usage"]

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one finished request."""

    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    """One step of a generation: a token and its text, or the end (``finish_reason`` set)."""

    token_id: int | None
    """The sampled token, or ``None`` on a final event that carries no token."""
    text: str
    """Newly decoded text that is safe to show (may be empty while text is held back)."""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    """Set on the final event only."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt ready to run: its token ids and, for multimodal models, the processor's
    inputs (image and audio features; the ids then hold negative image placeholders)."""

    ids: Sequence[int]
    media: Any = None

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)


_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
_request_ids = itertools.count(1)


@dataclass(eq=False)
class _Request:
    """Everything the owner thread keeps about one request."""

    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stops: StopMatcher
    deliver: Any  # Callable[[GenerationEvent | BaseException], None], thread-safe
    id: int = field(default_factory=lambda: next(_request_ids))
    tokens: list[int] = field(default_factory=list)
    decoder: Any = field(default_factory=lambda: decoders.DecodeStream(skip_special_tokens=True))
    constraint: Constraint | None = None
    media: Any = None
    """The processor's inputs for a multimodal prompt (see :class:`Prompt`)."""
    cancelled: bool = False
    row: int = -1
    prefilled: int = 0
    """Prompt tokens already in the cache (prompts are prefilled in chunks)."""
    decoded_chars: int = 0
    """Characters the streaming decoder produced so far."""

    @property
    def length(self) -> int:
        """Tokens in this request's cache row."""
        return len(self.prompt) + len(self.tokens)

    def advance(self, logits: npt.NDArray[np.float32], tokenizer: Tokenizer, eos: frozenset[int]) -> GenerationEvent:
        """Sample the next token from ``logits``; the event says whether the request is done."""
        sampler = self.sampler
        history = [t for t in self.prompt if t >= 0] + self.tokens if sampler.options.repetition_penalty != 1.0 else []
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        token = sampler.choose(logits, history, len(self.tokens))
        self.tokens.append(token)
        complete = self.constraint is not None and self.constraint.advance(token)
        if token in eos:
            return self.final("stop", self.stops.feed(self._tail(tokenizer, eos))[0] + self.stops.flush())
        piece = self.decoder.step(tokenizer, token) or ""
        self.decoded_chars += len(piece)
        if complete or len(self.tokens) >= self.max_tokens:
            piece += self._tail(tokenizer, eos)
        text, stopped = self.stops.feed(piece)
        if stopped:
            return self.final("stop", text, token)
        if complete:
            return self.final("stop", text + self.stops.flush(), token)
        if len(self.tokens) >= self.max_tokens:
            return self.final("length", text + self.stops.flush(), token)
        return GenerationEvent(token_id=token, text=text)

    def final(self, reason: FinishReason, text: str = "", token: int | None = None) -> GenerationEvent:
        usage = Usage(prompt_tokens=len(self.prompt), completion_tokens=len(self.tokens))
        return GenerationEvent(token_id=token, text=text, finish_reason=reason, usage=usage)

    def _tail(self, tokenizer: Tokenizer, eos: frozenset[int]) -> str:
        """Text the streaming decoder still holds (an unfinished UTF-8 sequence at the end),
        rendered the way a full decode renders it."""
        tokens = [t for t in self.tokens if t not in eos]
        return str(tokenizer.decode(tokens, skip_special_tokens=True))[self.decoded_chars :]


class GenerationStream:
    """Async iterator of :class:`GenerationEvent` for one request.

    The request reaches the engine on the first ``__anext__``. Leaving early (``break``,
    ``aclose()``, or cancelling the consuming task) cancels it in the engine and frees its
    batch row; :meth:`cancel` ends it with a final ``"cancelled"`` event instead.
    """

    def __init__(self, model: ChatModel, request: _Request) -> None:
        self._model = model
        self._request = request
        self._queue: asyncio.Queue[GenerationEvent | BaseException] = asyncio.Queue()
        self._started = False
        self._done = False
        self.prompt_tokens = len(request.prompt)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        if not self._started and self._request.cancelled:  # cancelled before it was read
            self._done = True
            return self._request.final("cancelled")
        if not self._started:
            self._started = True
            loop = asyncio.get_running_loop()
            queue = self._queue

            def deliver(item: GenerationEvent | BaseException) -> None:
                try:
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                except RuntimeError:  # the consumer's loop is gone: nobody wants the rest
                    self._model._cancel(self._request)

            self._request.deliver = deliver
            self._model._submit(self._request)
        try:
            item = await self._queue.get()
        except BaseException:
            self._abandon()
            raise
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finish_reason is not None:
            self._done = True
        return item

    def cancel(self) -> None:
        """Stop generating; the stream then ends with a ``"cancelled"`` event."""
        if not self._started:
            self._request.cancelled = True  # never submitted: the first read ends it
        elif not self._done:
            self._model._cancel(self._request)

    async def aclose(self) -> None:
        """Stop consuming; the engine drops the request at its next step."""
        self._abandon()

    def _abandon(self) -> None:
        if self._started and not self._done:
            self._done = True
            self._model._cancel(self._request)

    async def collect(self) -> tuple[str, list[int], FinishReason, Usage]:
        """Run to the end and return text, token ids, finish reason and usage."""
        text: list[str] = []
        tokens: list[int] = []
        async for event in self:
            text.append(event.text)
            if event.token_id is not None:
                tokens.append(event.token_id)
            if event.finish_reason is not None:
                assert event.usage is not None
                return "".join(text), tokens, event.finish_reason, event.usage
        raise EngineClosedError("the generation ended without a final event")


class _DecoderGraph:
    """The decoder ONNX graph and the names genai_config.json gives its inputs/outputs."""

    def __init__(self, folder: Path, genai: Mapping[str, Any], config: ModelConfig) -> None:
        decoder = genai["model"]["decoder"]
        self.layers = int(decoder["num_hidden_layers"])
        self.kv_heads = int(decoder.get("num_key_value_heads", decoder["num_attention_heads"]))
        self.head_size = int(decoder["head_size"])
        names = decoder.get("inputs", {})
        outputs = decoder.get("outputs", {})
        past_key = names.get("past_key_names", "past_key_values.%d.key")
        past_value = names.get("past_value_names", "past_key_values.%d.value")
        present_key = outputs.get("present_key_names", "present.%d.key")
        present_value = outputs.get("present_value_names", "present.%d.value")
        self.cache_names = [
            (past_key % i, present_key % i, past_value % i, present_value % i) for i in range(self.layers)
        ]
        self.input_ids = names.get("input_ids", "input_ids")
        self.attention_mask = names.get("attention_mask", "attention_mask")
        self.position_ids = names.get("position_ids", "position_ids")
        self.logits = outputs.get("logits", "logits")

        model_path = folder / decoder.get("filename", "model.onnx")
        if not model_path.exists():
            raise ModelLoadError(f"{model_path} does not exist", path=model_path)
        options = ort.SessionOptions()
        if config.intra_op_threads is not None:
            options.intra_op_num_threads = config.intra_op_threads
        options.inter_op_num_threads = 1
        for key, value in config.session_options.items():
            options.add_session_config_entry(key, value)
        try:
            self.session = _open_session(model_path, options, self.logits, last_only=config.last_position_logits)
        except Exception as exc:  # onnx/onnxruntime raise their own untyped errors for corrupt files
            raise ModelLoadError(f"{model_path} could not be loaded by onnxruntime: {exc}", path=model_path) from exc
        inputs = {i.name: i for i in self.session.get_inputs()}
        needed = [self.input_ids, self.attention_mask, self.cache_names[0][0]]
        missing = [n for n in needed if n not in inputs]
        if missing:
            raise ModelLoadError(
                f"{model_path} is not a decoder this runtime can drive (missing inputs {missing})", path=model_path
            )
        self.has_position_ids = self.position_ids in inputs
        self.ids_dtype = np.int32 if inputs[self.input_ids].type == "tensor(int32)" else np.int64
        self.mask_dtype = np.int32 if inputs[self.attention_mask].type == "tensor(int32)" else np.int64
        cache_type = inputs[self.cache_names[0][0]].type
        if cache_type not in _DTYPES:
            raise ModelLoadError(
                f"{model_path} has a key/value cache of unsupported type {cache_type}", path=model_path
            )
        self.cache_dtype = _DTYPES[cache_type]


class ChatModel:
    """What text and multimodal generative models share: the tokenizer, the chat template,
    the tool-call format, grammars, and the checks that turn a prompt into a request.

    Subclasses run the requests (``_submit``/``_cancel``) and may accept media
    (``modalities``, ``_placeholders``, ``_prepare``).
    """

    kind: Literal["generative"] = "generative"

    def __init__(self, name: str, folder: Path, config: ModelConfig, genai: Mapping[str, Any]) -> None:
        if config.provider != "cpu":
            raise ModelLoadError(
                f"cannot load {folder} on provider {config.provider!r}: generation runs on the CPU provider "
                "only in this release",
                path=folder,
            )
        self.name = name
        self.folder = folder
        self.config = config
        self.modalities: frozenset[str] = frozenset()
        """Inputs besides text: ``"image"``, ``"audio"``."""
        self._placeholders: Placeholders = {}
        try:
            model = genai["model"]
            self.context_length = int(model["context_length"])
            eos = model.get("eos_token_id", [])
            self.eos_token_ids = frozenset(int(e) for e in (eos if isinstance(eos, list) else [eos]))
            self.vocab_size = int(model["vocab_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{folder / 'genai_config.json'} lacks a required field: {exc}", path=folder) from exc
        tokenizer_path = folder / "tokenizer.json"
        if not tokenizer_path.exists():
            raise ModelLoadError(f"{tokenizer_path} does not exist", path=tokenizer_path)
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # tokenizers raises plain Exception on bad files
            raise ModelLoadError(f"{tokenizer_path} is not a valid tokenizer: {exc}", path=tokenizer_path) from exc
        self.chat_template = ChatTemplate.from_folder(folder)
        self.tool_format: ToolCallFormat | None = detect_tool_format(
            self.chat_template.source if self.chat_template else None
        )
        """How this model writes tool calls (from its chat template), or None."""
        self.grammars = GrammarCompiler(tokenizer_path.read_text(encoding="utf-8"), self.vocab_size, self.eos_token_ids)
        self.max_sequence_length = min(self.context_length, config.max_sequence_length or self.context_length)
        # The owner thread (started by the subclass) takes requests from here.
        self._closing = False
        self._cond = threading.Condition()
        self._inbox: deque[_Request] = deque()
        self._cancels: set[_Request] = set()
        self._thread = threading.Thread(target=self._run, name=f"ortserve-{name}", daemon=True)

    @property
    def queued(self) -> int:
        """Requests waiting to start."""
        return len(self._inbox)

    @property
    def active(self) -> int:
        """Requests being generated now."""
        raise NotImplementedError

    # -- public API (any thread / asyncio) -------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

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
    ) -> str:
        """The prompt text the model's own template makes of ``messages`` (and ``tools``).

        Content may be a list of parts (text, :class:`ImageInput`, :class:`AudioInput`);
        media parts appear as the model's placeholders.
        """
        return self._render(messages, tools, add_generation_prompt)[0]

    def prepare_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> Prompt:
        """The prompt for ``messages``, ready for :meth:`generate` (``n`` choices may share it);
        ``list(prompt)`` gives its token ids (images as the negative ids of their features).

        For multimodal models this decodes the media and runs the processor: call it from a
        worker thread in asyncio code (:meth:`aprepare_chat`).
        """
        text, media = self._render(messages, tools, add_generation_prompt)
        return self._prepare(text, media)

    async def aprepare_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> Prompt:
        """:meth:`prepare_chat` without blocking the event loop on media."""
        if not self.modalities:
            return self.prepare_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return await asyncio.to_thread(
            self.prepare_chat, messages, tools=tools, add_generation_prompt=add_generation_prompt
        )

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
        """
        options = options or GenerationOptions()
        options.validate()
        if self._closing:
            raise EngineClosedError(f"model {self.name!r} is closed")
        if (prompt is None) == (messages is None):
            raise InvalidRequestError("give either a prompt or messages", param="prompt")
        if messages is not None:
            prompt = self.prepare_chat(messages, tools=tools)
        elif isinstance(prompt, str):
            prompt = Prompt(self.encode(prompt))
        elif not isinstance(prompt, Prompt):
            ids = [int(t) for t in prompt or ()]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
            prompt = Prompt(ids)
        field_name = "messages" if messages is not None else "prompt"
        if not prompt.ids:
            raise InvalidRequestError("the prompt is empty", param=field_name)
        room = self.max_sequence_length - len(prompt.ids)
        if room < 1 or (options.max_tokens is not None and options.max_tokens > room):
            asked = f" plus max_tokens {options.max_tokens}" if options.max_tokens is not None else ""
            raise ContextLengthError(
                f"the prompt has {len(prompt.ids)} tokens{asked}, more than this model's limit of "
                f"{self.max_sequence_length} tokens",
                param="max_tokens" if room >= 1 else field_name,
            )
        constraint = self.grammars.constraint(options.grammar) if options.grammar is not None else None
        request = _Request(
            prompt=list(prompt.ids),
            media=prompt.media,
            constraint=constraint,
            max_tokens=options.max_tokens if options.max_tokens is not None else room,
            sampler=Sampler(options, self.eos_token_ids),
            stops=StopMatcher(options.stop),
            deliver=None,
        )
        return GenerationStream(self, request)

    # -- for subclasses ----------------------------------------------------------------------

    def _render(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool
    ) -> tuple[str, Media]:
        if self.chat_template is None:
            raise InvalidRequestError(f"model {self.name!r} has no chat template; use completions", param="messages")
        flat, media = flatten_messages(messages, self._placeholders, self.name)
        return self.chat_template.render(flat, tools=tools, add_generation_prompt=add_generation_prompt), media

    def _prepare(self, text: str, media: Media) -> Prompt:
        """The prompt of a rendered chat (text models: its tokens)."""
        return Prompt(self.encode(text, add_special_tokens=False))

    def _run(self) -> None:
        raise NotImplementedError

    # -- bridge to the owner thread --------------------------------------------------------

    async def close(self) -> None:
        """Finish: pending requests get :class:`EngineClosedError`; the thread exits."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)

    def _submit(self, request: _Request) -> None:
        with self._cond:
            if self._closing:
                request.deliver(EngineClosedError(f"model {self.name!r} is closed"))
                return
            self._inbox.append(request)
            self._cond.notify()

    def _cancel(self, request: _Request) -> None:
        with self._cond:
            request.cancelled = True
            self._cancels.add(request)
            self._cond.notify()


class GenerativeModel(ChatModel):
    """A text generation model served with continuous batching (see the module docstring).

    Use :meth:`generate` from asyncio code; call :meth:`close` when done.
    """

    def __init__(self, name: str, folder: Path, config: ModelConfig) -> None:
        genai = _read_json(folder / "genai_config.json")
        model = genai.get("model")
        if isinstance(model, dict) and ("vision" in model or "speech" in model or "encoder" in model):
            raise ModelLoadError(
                f"{folder} is a multimodal or encoder-decoder model ({model.get('type')}); "
                "only decoder-only text models run on this engine",
                path=folder,
            )
        super().__init__(name, folder, config, genai)
        self._graph = _DecoderGraph(folder, genai, config)
        self.max_batch_size = config.max_batch_size
        shape = (self.max_batch_size, self._graph.kv_heads, self.max_sequence_length, self._graph.head_size)
        # np.zeros maps untouched pages lazily: memory grows with the tokens actually cached.
        self._cache = [
            (np.zeros(shape, self._graph.cache_dtype), np.zeros(shape, self._graph.cache_dtype))
            for _ in range(self._graph.layers)
        ]
        self._rows: list[_Request] = []
        self._prefilling: _Request | None = None
        """The request whose prompt is going into the cache, at row ``len(self._rows)``."""
        self.prefill_chunk = config.prefill_chunk_tokens
        self.steps = 0
        """Decoder runs so far (prefills plus batched decode steps); for tests and metrics."""
        self._thread.start()

    @property
    def active(self) -> int:
        """Requests holding a batch row now (decoding, or having their prompt prefilled)."""
        return len(self._rows) + (self._prefilling is not None)

    # -- owner thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._rows or self._prefilling or self._closing or self._cancels):
                    self._cond.wait()
                if self._closing:
                    break
                cancels, self._cancels = self._cancels, set()
                for request in cancels:
                    if request in self._inbox:
                        self._inbox.remove(request)
                        request.deliver(request.final("cancelled"))
            for request in cancels:
                if request is self._prefilling:
                    self._prefilling, request.row = None, -1
                    request.deliver(request.final("cancelled"))
                elif request.row >= 0:
                    self._finish(request, "cancelled")
            try:
                self._prefill_work()
                if self._rows:
                    self._decode_step()
            except Exception as exc:  # noqa: BLE001  # an onnxruntime failure: fail the requests it touched
                failed = [*self._rows, *([self._prefilling] if self._prefilling else [])]
                self._prefilling = None
                for request in failed:
                    if request in self._rows:
                        self._release(request)
                    request.row = -1
                    request.deliver(EngineError(f"generation failed: {exc}"))
        error = EngineClosedError(f"model {self.name!r} was closed")
        for request in [*self._inbox, *self._rows, *([self._prefilling] if self._prefilling else [])]:
            request.deliver(error)
        self._inbox.clear()
        self._rows.clear()
        self._prefilling = None

    def _prefill_work(self) -> None:
        """Put waiting prompts into the cache, one chunk at a time.

        Prompts that fit in a chunk are admitted back to back (low time to first token
        when many arrive together). A longer prompt takes one chunk per engine step, with
        a decode step of the running requests in between, so their streams keep flowing.
        """
        while True:
            if self._prefilling is None:
                with self._cond:
                    if not self._inbox or len(self._rows) >= self.max_batch_size:
                        return
                    request = self._inbox.popleft()
                if request.cancelled:
                    request.deliver(request.final("cancelled"))
                    continue
                request.row, request.prefilled = len(self._rows), 0
                self._prefilling = request
            request = self._prefilling
            logits = self._prefill_chunk(request)
            if logits is None:
                if self._rows:
                    return  # a long prompt: let the running requests take a step
                continue
            self._prefilling = None
            self._rows.append(request)
            self._accept(request, logits)

    def _bind(self, rows: slice, input_ids: npt.NDArray[Any], mask: npt.NDArray[Any], positions: Any) -> Any:
        graph = self._graph
        binding = graph.session.io_binding()
        binding.bind_cpu_input(graph.input_ids, input_ids)
        binding.bind_cpu_input(graph.attention_mask, mask)
        if graph.has_position_ids:
            binding.bind_cpu_input(graph.position_ids, positions)
        for (past_k, present_k, past_v, present_v), (keys, values) in zip(graph.cache_names, self._cache, strict=True):
            # The same buffer as past and present: GQA appends in place (share-buffer mode).
            key_value = ort.OrtValue.ortvalue_from_numpy(keys[rows])
            value_value = ort.OrtValue.ortvalue_from_numpy(values[rows])
            binding.bind_ortvalue_input(past_k, key_value)
            binding.bind_ortvalue_output(present_k, key_value)
            binding.bind_ortvalue_input(past_v, value_value)
            binding.bind_ortvalue_output(present_v, value_value)
        binding.bind_output(graph.logits)
        graph.session.run_with_iobinding(binding)
        self.steps += 1
        logits: npt.NDArray[np.float32] = binding.get_outputs()[-1].numpy()
        return logits

    def _prefill_chunk(self, request: _Request) -> npt.NDArray[np.float32] | None:
        """Cache the next chunk of the prompt; the last chunk returns the logits."""
        graph = self._graph
        start = request.prefilled
        end = min(len(request.prompt), start + self.prefill_chunk)
        ids = np.asarray([request.prompt[start:end]], dtype=graph.ids_dtype)
        # The mask spans everything cached so far: GQA appends the chunk after it.
        mask = np.ones((1, end), dtype=graph.mask_dtype)
        positions = np.arange(start, end, dtype=graph.ids_dtype)[None, :]
        logits = self._bind(slice(request.row, request.row + 1), ids, mask, positions)
        request.prefilled = end
        return logits[0, -1] if end == len(request.prompt) else None

    def _decode_step(self) -> None:
        graph = self._graph
        rows = list(self._rows)
        lengths = np.fromiter((r.length for r in rows), dtype=np.int64, count=len(rows))
        ids = np.fromiter((r.tokens[-1] for r in rows), dtype=graph.ids_dtype, count=len(rows))[:, None]
        # Each row's new token sits right after its own cached tokens (right-aligned cache).
        width = int(lengths.max())
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(graph.mask_dtype)
        positions = (lengths - 1).astype(graph.ids_dtype)[:, None]
        logits = self._bind(slice(0, len(rows)), ids, mask, positions)
        for request, row_logits in zip(rows, logits[:, -1], strict=True):
            if not request.cancelled:
                self._accept(request, row_logits)

    def _accept(self, request: _Request, logits: npt.NDArray[np.float32]) -> None:
        """Sample the next token of ``request`` and tell its consumer."""
        event = request.advance(logits, self.tokenizer, self.eos_token_ids)
        if event.finish_reason is not None:
            self._release(request)
        request.deliver(event)

    def _finish(self, request: _Request, reason: FinishReason) -> None:
        self._release(request)
        request.deliver(request.final(reason))

    def _release(self, request: _Request) -> None:
        """Free the request's row; the last row moves into the hole so rows stay dense."""
        row = request.row
        if row < 0:
            return
        last = self._rows.pop()
        if last is not request:
            self._copy_row(last.row, row, last.length)
            self._rows[row] = last
            last.row = row
        request.row = -1
        pending = self._prefilling
        if pending is not None and pending.row != len(self._rows):
            # The prompt being prefilled sits right after the running rows: follow them down.
            self._copy_row(pending.row, len(self._rows), pending.prefilled)
            pending.row = len(self._rows)

    def _copy_row(self, source: int, target: int, length: int) -> None:
        for keys, values in self._cache:
            keys[target, :, :length] = keys[source, :, :length]
            values[target, :, :length] = values[source, :, :length]


def _open_session(
    model_path: Path, options: ort.SessionOptions, logits: str, *, last_only: bool
) -> ort.InferenceSession:
    """An onnxruntime session for the decoder, computing logits of the last position only.

    Sampling needs only the last position's logits, yet the builder's graphs project every
    prompt position through the vocabulary-sized LM head (a quarter of the prefill work
    for a 0.5B model, measured). A Gather of the last position in front of the node that
    writes the logits removes that work; decode steps (one position) are unchanged.
    """
    providers = ["CPUExecutionProvider"]
    if not last_only:
        return ort.InferenceSession(str(model_path), options, providers=providers)
    graph_model = onnx.load(str(model_path), load_external_data=False)
    graph = graph_model.graph
    producers = [node for node in graph.node if logits in node.output]
    outputs = [o for o in graph.output if o.name == logits]
    if len(producers) != 1 or len(outputs) != 1 or len(outputs[0].type.tensor_type.shape.dim) != 3:
        return ort.InferenceSession(str(model_path), options, providers=providers)
    head = producers[0]
    index_name, hidden_name = "ortserve/last_position", "ortserve/last_position_hidden"
    graph.initializer.append(onnx.numpy_helper.from_array(np.array([-1], dtype=np.int64), name=index_name))
    gather = onnx.helper.make_node("Gather", [head.input[0], index_name], [hidden_name], axis=1, name=hidden_name)
    head.input[0] = hidden_name
    graph.node.insert(list(graph.node).index(head), gather)
    outputs[0].type.tensor_type.shape.dim[1].dim_value = 1
    # Weights stay in their external data files: handed to onnxruntime as memory maps, which
    # also works where they are symlinks out of the folder (the Hugging Face cache).
    locations = sorted(
        {
            entry.value
            for tensor in graph.initializer
            if tensor.data_location == onnx.TensorProto.EXTERNAL
            for entry in tensor.external_data
            if entry.key == "location"
        }
    )
    with contextlib.ExitStack() as stack:
        maps = []
        for location in locations:
            handle = stack.enter_context((model_path.parent / location).open("rb"))
            maps.append(stack.enter_context(mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)))
        if maps:
            options.add_external_initializers_from_files_in_memory(locations, maps, [len(m) for m in maps])
        return ort.InferenceSession(graph_model.SerializeToString(), options, providers=providers)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ModelLoadError(f"{path} does not exist", path=path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}", path=path) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object", path=path)
    return data
