"""The request plan: an OpenAI request Struct checked once and mapped to runtime calls,
then started (:func:`start_chat`, :func:`start_completion`).

A route hands its request here with the model it holds (``_leases``); this module checks
it (a parameter this server cannot honour is refused with a 400 naming it, never ignored),
maps it to generation options, prepares the prompt and starts the runtime's streams, which
the route delivers through ``_generation``.

Long on purpose (over 600 lines): every parameter of a chat or completion request is
checked here, in one walk before anything starts, so none is checked twice or not at all.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from litestar import Request
from ortserve_client import protocol as p
from ortserve_runtime import (
    ChatModel,
    EmbeddingModel,
    GenerationOptions,
    GenerationStream,
    Grammar,
    InvalidRequestError,
    Prompt,
    RerankModel,
    ToolCallFormat,
    ToolCallParser,
    forced_tool_grammar,
)

from ._auth import Caller, caller_of
from ._config import ServerConfig
from ._connection import fetching_while_connected
from ._errors import BadRequestError, OverloadedError, UnsupportedParameterError
from ._messages import chat_messages
from ._record import record_prompt, span
from ._state import OrtServe
from ._thinking import reasoning_budget, template_kwargs

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_STOP",
    "MAX_TOOLS",
    "GenerationPlan",
    "Started",
    "check_chat_request",
    "check_room",
    "check_tool_count",
    "completion_prompts",
    "plan_chat",
    "plan_completion",
    "prepare_chat",
    "start_chat",
    "start_completion",
]

MAX_STOP = 4
MAX_TOOLS = 128
"""Tools one request may give (OpenAI's bound): each is mapped, checked and rendered into
the prompt on the way in (2,000 held the event loop 160 ms)."""
MAX_LOGIT_BIAS = 2048
"""``logit_bias`` entries (OpenAI takes 300; a digit mask of a 100k vocabulary needs ~1,100):
each is converted and checked against the vocabulary (1M entries took 880 ms)."""
MAX_TOP_LOGPROBS = 20
"""OpenAI's limit on chat ``top_logprobs``."""
MAX_COMPLETION_LOGPROBS = 5
"""OpenAI's limit on the legacy completions' ``logprobs``."""
T = TypeVar("T")
D = TypeVar("D")


def _given(value: Any) -> bool:
    return not isinstance(value, msgspec.UnsetType) and value is not None


def _or(value: T | msgspec.UnsetType | None, default: D) -> T | D:
    """``value`` unless the request left it out or sent null."""
    return default if value is None or isinstance(value, msgspec.UnsetType) else value


def check_room(
    state: OrtServe, model: ChatModel | EmbeddingModel | RerankModel, wanted: int, param: str, unit: str
) -> None:
    """Refuse, before any work starts, a request that fans out into ``wanted`` queue
    entries (prompts x ``n``, or an embedding or rerank request's batches) the queue has no room for:
    400 naming ``param`` when no queue could ever take it, else 503 + Retry-After. One
    request of 20,000 prompts queued 19,992 generations past ``max_queued`` of 64."""
    limit = state.config.max_queued
    if wanted > limit:
        raise BadRequestError(
            f"this request makes {wanted} {unit}; this server queues at most {limit} per model",
            param=param,
        )
    queued = model.queued
    if queued + wanted > limit:
        raise OverloadedError(
            f"model {model.name!r} has {queued} {unit} waiting, no room for {wanted} more; try again shortly",
            headers={"Retry-After": "1"},
        )


def _refuse(param: str, why: str = "is not supported by this server") -> UnsupportedParameterError:
    return UnsupportedParameterError(f"'{param}' {why}", param=param)


def _check_common(data: p.ChatCompletionRequest | p.CompletionRequest, config: ServerConfig) -> None:
    if _given(data.stream_options) and data.stream is not True:
        # As OpenAI: the options of a stream make no sense without one.
        raise BadRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    n = data.n if _given(data.n) else 1
    if not isinstance(n, int) or n < 1 or n > config.max_n:
        raise BadRequestError(f"'n' must be between 1 and {config.max_n}", param="n")
    if _given(data.lora):
        # llama-server mixes adapters by scale; onnxruntime's adapters have their scale
        # baked in and og activates one per generator, so a silent ignore would be wrong.
        raise _refuse(
            "lora",
            "is not supported: pick a LoRA adapter with the model id MODEL:ADAPTER (listed in /v1/models)",
        )
    stop = data.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise BadRequestError(f"'stop' allows at most {MAX_STOP} strings", param="stop")
    if isinstance(data.logit_bias, dict) and len(data.logit_bias) > MAX_LOGIT_BIAS:
        raise BadRequestError(
            f"'logit_bias' has {len(data.logit_bias)} entries; at most {MAX_LOGIT_BIAS}", param="logit_bias"
        )


def check_tool_count(tools: object, param: str = "tools") -> None:
    """A 400 for more than :data:`MAX_TOOLS` tools (Responses and Anthropic requests check
    their own first, then, mapped to a chat, with their MCP servers' tools)."""
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:
        raise BadRequestError(f"'{param}' has {len(tools)} tools; at most {MAX_TOOLS}", param=param)


def check_chat_request(data: p.ChatCompletionRequest, config: ServerConfig) -> None:
    """Refuse what we cannot honour, naming the parameter."""
    _check_common(data, config)
    top = data.top_logprobs
    if _given(top) and not (isinstance(top, int) and 0 <= top <= MAX_TOP_LOGPROBS):
        raise BadRequestError(f"'top_logprobs' must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if isinstance(top, int) and top > 0 and data.logprobs is not True:
        raise BadRequestError("'top_logprobs' needs 'logprobs' set to true", param="top_logprobs")
    if not data.messages:
        raise BadRequestError("'messages' must not be empty", param="messages")
    check_tool_count(data.tools)  # for Responses and Anthropic requests, with their MCP servers' tools
    for number, tool in enumerate(data.tools if isinstance(data.tools, list) else []):
        schema = tool.function.parameters
        if isinstance(schema, dict) and schema.get("type", "object") != "object":  # as OpenAI refuses it
            raise BadRequestError(
                f"a function's parameters must be a JSON schema of type 'object', not {schema.get('type')!r}",
                param=f"tools[{number}].function.parameters",
            )
    if isinstance(data.modalities, list) and set(data.modalities) - {"text"}:
        raise _refuse("modalities", "asks for output this server does not make: it writes text only")
    if _given(data.audio):
        raise _refuse("audio", "(audio output) is not supported: models here write text only")
    # Taken at their defaults (twenty-second probe: the SDKs' store=False or service_tier="auto" were 400s).
    if data.store is True:
        raise _refuse("store", "is not supported: chat completions are not stored here (the Responses API stores)")
    if data.metadata:
        raise _refuse("metadata", "is kept with a stored completion, and chat completions are not stored here")
    if data.service_tier not in (msgspec.UNSET, None, "auto", "default"):
        raise _refuse("service_tier", f"{data.service_tier!r} is not supported: this server has one tier ('default')")
    if data.verbosity not in (msgspec.UNSET, None, "medium"):
        raise _refuse("verbosity", "is not supported other than 'medium', the model's own length")


def check_completion_request(data: p.CompletionRequest, config: ServerConfig) -> None:
    _check_common(data, config)
    logprobs = data.logprobs
    if _given(logprobs) and not (isinstance(logprobs, int) and 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise BadRequestError(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}", param="logprobs")
    if data.max_tokens == 0 and data.echo is not True:
        raise BadRequestError(
            "'max_tokens' must be at least 1 (0 only with 'echo': the prompt alone)", param="max_tokens"
        )
    if _prompt_only(data) and _or(data.min_tokens, 0) > 0:  # here: one token may be generated, and dropped
        raise BadRequestError("'min_tokens' must not exceed 'max_tokens'", param="min_tokens")
    if _given(data.suffix) and data.suffix:
        raise _refuse("suffix")
    if _given(data.best_of) and data.best_of != 1:
        raise _refuse("best_of")


def completion_prompts(prompt: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The four prompt forms of the completions API as a list of prompts."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequestError("'prompt' must not be empty", param="prompt")
    if all(isinstance(x, int) for x in prompt):
        return [[int(x) for x in prompt]]  # type: ignore[arg-type]
    if all(isinstance(x, str) for x in prompt):
        return [str(x) for x in prompt]
    if all(isinstance(x, list) for x in prompt):
        return [list(x) for x in prompt]  # type: ignore[arg-type]
    raise BadRequestError(
        "'prompt' must be a string, strings, token ids or lists of token ids, not a mix", param="prompt"
    )


def _check_grammar_size(grammar: Grammar, field: str, config: ServerConfig) -> None:
    """Compiling a grammar takes time in proportion to its size (50,000 guided_choice
    options took 6 s): larger ones are refused before they reach the compiler."""
    source = grammar.source
    size = len(source.encode()) if isinstance(source, str) else len(msgspec.json.encode(source))
    if size > config.max_grammar_bytes:
        raise BadRequestError(
            # Not naming the field: param does, as the route spells it (Responses: text.format).
            f"the grammar is {size} bytes; this server compiles at most {config.max_grammar_bytes}",
            param=field,
        )


def _grammar_of(
    data: p.ChatCompletionRequest | p.CompletionRequest, config: ServerConfig
) -> tuple[Grammar, str] | None:
    """The output constraint a request asks for, with the field that asked for it."""
    asked: list[tuple[Grammar, str]] = []
    response_format = data.response_format
    if isinstance(response_format, p.ResponseFormatJSONObject):
        asked.append((Grammar("json_schema", {"type": "object"}), "response_format"))
    elif isinstance(response_format, p.ResponseFormatJSONSchema):
        schema = response_format.json_schema.schema
        if not isinstance(schema, dict):
            raise BadRequestError("response_format.json_schema.schema is required", param="response_format")
        asked.append((Grammar("json_schema", schema), "response_format"))
    if _given(data.guided_json):
        asked.append((Grammar("json_schema", _guided_json_schema(data.guided_json)), "guided_json"))
    if _given(data.guided_regex):
        asked.append((Grammar("regex", str(data.guided_regex)), "guided_regex"))
    if _given(data.guided_grammar):
        asked.append((Grammar("lark", str(data.guided_grammar)), "guided_grammar"))
    if isinstance(data.guided_choice, list):
        if not data.guided_choice or not all(data.guided_choice):
            raise BadRequestError("guided_choice needs non-empty strings", param="guided_choice")
        if len(data.guided_choice) > config.max_guided_choices:
            raise BadRequestError(
                f"guided_choice has {len(data.guided_choice)} options; this server takes at most "
                f"{config.max_guided_choices}",
                param="guided_choice",
            )
        # Lark string literals share JSON's escapes, so json.dumps quotes each choice.
        lark = "start: " + " | ".join(json.dumps(choice) for choice in data.guided_choice)
        asked.append((Grammar("lark", lark), "guided_choice"))
    if len(asked) > 1:
        raise BadRequestError(
            f"ask for one output constraint, not {' and '.join(field for _, field in asked)}", param=asked[1][1]
        )
    for grammar, field in asked:
        _check_grammar_size(grammar, field, config)
    return asked[0] if asked else None


def _guided_json_schema(guided: Any) -> dict[str, Any]:
    """vLLM's ``guided_json``: a schema, or its JSON text."""
    if isinstance(guided, str):
        try:
            guided = json.loads(guided)
        except ValueError:
            raise BadRequestError(
                "guided_json must be a JSON schema (an object or its JSON text)", param="guided_json"
            ) from None
        except RecursionError:
            raise BadRequestError("guided_json is nested too deeply", param="guided_json") from None
    if not isinstance(guided, dict):
        raise BadRequestError("guided_json must be a JSON schema object", param="guided_json")
    return guided


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request's ``tools``/``tool_choice`` mean for this model."""

    definitions: list[dict[str, Any]] | None = None
    """Tool schemas for the chat template (``None``: no tools in the prompt)."""
    format: ToolCallFormat | None = None
    """Parse the output for calls in this format (``None``: plain content)."""
    grammar: Grammar | None = None
    """Force a call (``required`` or a named function), or let the output be a call or an
    answer in the response format (``auto`` with a JSON schema format)."""
    forced: str | None = None
    """The name of the function a forced call must call (``""``: any of several), else ``None``."""


def _tool_plan(
    data: p.ChatCompletionRequest, model: ChatModel, constraint: tuple[Grammar, str] | None, config: ServerConfig
) -> ToolPlan:
    tools = data.tools if isinstance(data.tools, list) and data.tools else None
    choice = data.tool_choice if _given(data.tool_choice) else ("auto" if tools else "none")
    if tools is None:
        if choice not in ("none", "auto"):
            raise BadRequestError("tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    definitions = [msgspec.to_builtins(tool) for tool in tools]
    if choice == "none":
        return ToolPlan(definitions=definitions)
    if model.tool_format is None:
        raise BadRequestError(f"model {model.name!r} has no known tool-call format in its chat template", param="tools")
    if choice == "auto":
        if constraint is not None and constraint[0].kind != "json_schema":
            # It would hold the whole reply: the tools beside it could never be called (a
            # 200 that took them: twenty-seventh probe, issue 45).
            raise BadRequestError(
                f"{constraint[1]} holds the whole reply, so the model could not call the tools beside it "
                "(tool_choice auto): send tool_choice none to answer in it, or a JSON schema, which goes beside tools",
                param=constraint[1],
            )
        if constraint is not None and isinstance(constraint[0].source, dict):
            # A call, or an answer in the response format: the format must not rule calls out.
            either = forced_tool_grammar(
                model.tool_format,
                definitions,
                token_id=model.tokenizer.token_to_id,
                or_answer=constraint[0].source,
                answer_field=constraint[1],
            )
            if either is not None:
                _check_grammar_size(either, "tools", config)
                return ToolPlan(definitions, model.tool_format, either)
        return ToolPlan(definitions, model.tool_format)
    name = choice.function.name if isinstance(choice, p.NamedToolChoice) else None
    if name is not None and name not in {t.function.name for t in tools}:
        raise BadRequestError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    # A response format given with a forced call shapes later text turns; this turn is the
    # call (as OpenAI does). The format must compile all the same.
    grammar = forced_tool_grammar(model.tool_format, definitions, name, model.tokenizer.token_to_id)
    assert grammar is not None  # the named tool is among them (checked above)
    if constraint is not None:
        grammar = dataclasses.replace(grammar, beside=(constraint[1], constraint[0]))
    _check_grammar_size(grammar, "tools", config)
    # "required" with one tool forces that one: a call cut before its name still names it.
    only = tools[0].function.name if len(tools) == 1 else ""
    return ToolPlan(definitions, model.tool_format, grammar, name or only)


def _scoped_salt(salt: str | None, scope: str | None) -> str | None:
    """The salt the engine keys cached rows by: the request's own within its caller's scope."""
    return salt if scope is None else f"key:{scope}:{salt or ''}"


def _generation_options(
    data: p.ChatCompletionRequest | p.CompletionRequest,
    config: ServerConfig,
    n: int,
    grammar: Grammar | None,
    caller: Caller,
    reasoning_budget: int | None = None,
) -> list[GenerationOptions]:
    """Runtime options for each of the ``n`` choices (seeds differ per choice)."""
    max_tokens = _or(getattr(data, "max_completion_tokens", None), None)
    if max_tokens is None:
        max_tokens = _or(data.max_tokens, None)
    limit = config.max_tokens_limit
    if max_tokens is not None and limit is not None and max_tokens > limit:
        raise BadRequestError(f"max_tokens may be at most {limit} on this server", param="max_tokens")
    if max_tokens is None:
        max_tokens = limit
    stop = data.stop
    stops: tuple[str, ...] = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else ()
    top_k = _or(data.top_k, 0)
    seed = _or(data.seed, None)
    bias = _logit_bias(data.logit_bias)
    prompt_logprobs = None
    if isinstance(data, p.ChatCompletionRequest):
        logprobs = _or(data.top_logprobs, 0) if data.logprobs is True else None
    else:
        logprobs = _or(data.logprobs, None)
        if data.echo is True:  # the prompt's tokens come first in the logprobs
            prompt_logprobs = logprobs
        if _prompt_only(data):
            # The prompt alone: scored where logprobs are asked for (0 tokens generated); else
            # one token is generated and dropped (as vLLM does), which any engine can do.
            max_tokens, logprobs = (0 if prompt_logprobs is not None else 1), None
    options = [
        GenerationOptions(
            max_tokens=max_tokens,
            temperature=_or(data.temperature, 1.0),
            top_p=_or(data.top_p, 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "disabled" as -1
            repetition_penalty=_or(data.repetition_penalty, 1.0),
            min_tokens=_or(data.min_tokens, 0),
            seed=None if seed is None else seed + i,
            stop=stops,
            grammar=grammar,
            logit_bias=bias,
            min_p=_or(data.min_p, 0.0),
            cache_salt=_scoped_salt(_or(data.cache_salt, None), caller.cache_scope),
            background=caller.background,
            prediction=_prediction(data.prediction),
            presence_penalty=_or(data.presence_penalty, 0.0),
            frequency_penalty=_or(data.frequency_penalty, 0.0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            reasoning_budget=reasoning_budget,
        )
        for i in range(n)
    ]
    for o in options:
        o.validate()
    return options


def _prompt_only(data: p.CompletionRequest) -> bool:
    """Whether a completion asks for its prompt alone (``echo`` with ``max_tokens`` 0, as
    lm-evaluation-harness scores a text)."""
    return data.echo is True and data.max_tokens == 0


def _prediction(given: p.PredictionContent | msgspec.UnsetType | None) -> str | None:
    """The text of a ``prediction`` (a string, or text parts joined as OpenAI joins them)."""
    if not isinstance(given, p.PredictionContent):
        return None
    content = given.content
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _logit_bias(given: dict[str, float] | msgspec.UnsetType | None) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys) with integer keys; the model
    checks that each id is in its vocabulary, the options that each bias is in range."""
    if not isinstance(given, dict):
        return {}
    bias: dict[int, float] = {}
    for key, value in given.items():
        try:
            bias[int(key)] = float(value)
        except ValueError:
            raise BadRequestError(f"logit_bias keys must be token ids, not {key!r}", param="logit_bias") from None
    return bias


@dataclass(frozen=True, slots=True)
class GenerationPlan:
    """A chat or completion request mapped once: the options of each of its ``n`` choices,
    its tools, and which request field each runtime parameter came from."""

    n: int
    options: list[GenerationOptions]
    tools: ToolPlan
    fields: Mapping[str, str]
    """The runtime's ``param`` of an error -> the request's field (``prompt`` -> ``messages``,
    ``grammar`` -> ``response_format``, ``guided_regex``, ``tool_choice``...)."""
    prompt_only: bool = False
    """A completion with ``echo`` and ``max_tokens`` 0: its answer is the prompt alone; what
    the runtime generates (one token, where the prompt is not scored) is dropped."""
    lane: tuple[str, bool] = ("", False)
    """Whose it is (the caller's owner, and whether a batch line): a model's grammar
    threads take the lanes in turn."""

    def start(self, model: ChatModel, prompts: Sequence[str | list[int] | Prompt]) -> list[GenerationStream]:
        """One stream per prompt and choice (their grammar built once and copied); a refusal
        names the request's field."""
        try:
            with model.grammars.sharing():
                return [model.generate(prompt, options=o) for prompt in prompts for o in self.options]
        except InvalidRequestError as exc:
            raise self.named(exc) from exc

    def fitted(self, model: ChatModel, prompt: Prompt) -> GenerationPlan:
        """This plan with ``max_tokens`` cut to what ``model``'s context leaves after
        ``prompt``: for a tool loop's later turns, whose prompts grew with calls and
        results the caller did not size ``max_tokens`` for."""
        room = model.max_sequence_length - len(prompt)
        if room < 1:
            return self  # the prompt alone does not fit: the model's refusal says so
        options = [
            o if o.max_tokens is None or o.max_tokens <= room else dataclasses.replace(o, max_tokens=room)
            for o in self.options
        ]
        return dataclasses.replace(self, options=options)

    def named(self, exc: InvalidRequestError) -> InvalidRequestError:
        """``exc`` naming the request's field (``grammar`` -> ``response_format``...)."""
        if exc.param is not None and exc.param in self.fields:
            return type(exc)(str(exc), param=self.fields[exc.param])
        return exc

    async def astart(
        self, state: OrtServe, model: ChatModel, prompts: Sequence[str | list[int] | Prompt]
    ) -> list[GenerationStream]:
        """:meth:`start` for the server: every generation the request fans out into counts
        against ``max_queued``, and tokenizing and grammar compiling run in a worker thread
        (a 15 MB prompt froze every stream for 13 s on the event loop)."""
        wanted = len(prompts) * self.n
        param = "prompt" if len(prompts) > 1 else "n"
        check_room(state, model, wanted, param, "generations")
        if any(o.grammar is not None for o in self.options):  # on its model's grammar threads, callers in turn
            run = functools.partial(contextvars.copy_context().run, self.start, model, prompts)
            streams = await asyncio.wrap_future(model.grammars.threads.submit(self.lane, run))
        else:
            streams = await asyncio.to_thread(self.start, model, prompts)
        # Others may have queued while this one was prepared: looked at again, with no
        # await between this check and handing the streams back to be read.
        check_room(state, model, wanted, param, "generations")
        return streams


def plan_chat(data: p.ChatCompletionRequest, model: ChatModel, config: ServerConfig, caller: Caller) -> GenerationPlan:
    """Check a chat request (a 400 naming any parameter it cannot honour) and map it;
    ``caller``: who sent it (:func:`caller_of`), for its prefix-cache scope and priority."""
    check_chat_request(data, config)
    budget = reasoning_budget(data, model)
    constraint = _grammar_of(data, config)
    tools = _tool_plan(data, model, constraint, config)
    forced = data.tool_choice == "required" or isinstance(data.tool_choice, p.NamedToolChoice)
    if forced and tools.grammar and constraint and constraint[1] != "response_format":
        # A forced call's arguments follow its tool's schema. A response format shapes later
        # text turns (as OpenAI takes it); a guided_* constraint has no later turn: it was
        # dropped without a word (fourteenth probe of issue 45).
        raise BadRequestError(
            f"{constraint[1]} cannot constrain a reply that tool_choice forces to be a tool call: ask for one",
            param=constraint[1],
        )
    # A tools grammar is made of the tools' schemas (and a response format beside them): what
    # its compiler refuses is theirs (twenty-second probe: it was named tool_choice, sent or not).
    grammar, field = (tools.grammar, "tools") if tools.grammar else constraint or (None, "grammar")
    n = data.n if isinstance(data.n, int) else 1
    options = _generation_options(data, config, n, grammar, caller, budget)
    fields = {"prompt": "messages", "grammar": field}
    return GenerationPlan(n, options, tools, fields, lane=(caller.owner, caller.background))


def plan_completion(data: p.CompletionRequest, config: ServerConfig, caller: Caller) -> GenerationPlan:
    """Check a completion request (a 400 naming any parameter it cannot honour) and map it
    (``caller`` as for :func:`plan_chat`)."""
    check_completion_request(data, config)
    grammar, field = _grammar_of(data, config) or (None, "grammar")
    n = data.n if isinstance(data.n, int) else 1
    options = _generation_options(data, config, n, grammar, caller)
    fields = {"grammar": field, "prompt_logprobs": "echo"}
    return GenerationPlan(
        n, options, ToolPlan(), fields, prompt_only=_prompt_only(data), lane=(caller.owner, caller.background)
    )


@dataclass(frozen=True, slots=True)
class Started:
    """A generation request under way: what delivery (``_generation``) reads and reports."""

    model: ChatModel
    plan: GenerationPlan
    streams: list[GenerationStream]
    prompt_tokens: int
    """The request's prompt tokens, each prompt counted once (however many choices it has)."""
    prompt: Prompt | None = None
    """A chat's one prompt (where the model's thinking starts); ``None`` for completions."""
    tool_parsers: list[ToolCallParser] | None = None
    parallel_calls: bool = True


async def prepare_chat(
    state: OrtServe,
    model: ChatModel,
    data: p.ChatCompletionRequest,
    request: Request[Any, Any, Any] | None = None,
    *,
    queue: bool = True,
) -> tuple[GenerationPlan, Prompt]:
    """A chat request checked and mapped (:func:`plan_chat`), and its prompt prepared.
    ``queue``: the request will generate, so the queue's room is checked before the prompt
    is prepared (counting tokens queues nothing)."""
    plan = plan_chat(data, model, state.config, caller_of(request))
    if queue:
        check_room(state, model, plan.n, "n", "generations")
    with span("prepare_prompt", **{"gen_ai.request.model": model.name}):  # template, media
        messages = await chat_messages(data.messages, state.config, model, fetching_while_connected(request, state))
        prompt = await model.aprepare_chat(
            messages, tools=plan.tools.definitions, template_kwargs=template_kwargs(data, model)
        )
    record_prompt(data.messages)
    return plan, prompt


async def start_chat(
    state: OrtServe,
    model: ChatModel,
    data: p.ChatCompletionRequest,
    request: Request[Any, Any, Any] | None = None,
    *,
    fit: bool = False,
) -> Started:
    """A chat request checked, its prompt prepared and its generations started: what every
    API family that speaks in messages (chat completions, Responses, Anthropic) runs the
    same way. ``fit``: cut ``max_tokens`` to the room the prompt leaves (a tool loop's
    later turn)."""
    plan, prompt = await prepare_chat(state, model, data, request)
    if fit:
        plan = plan.fitted(model, prompt)
    streams = await plan.astart(state, model, [prompt])
    parsers = [ToolCallParser(plan.tools.format) for _ in streams] if plan.tools.format else None
    parallel = data.parallel_tool_calls is not False
    return Started(model, plan, streams, len(prompt), prompt, parsers, parallel)


async def start_completion(
    state: OrtServe, model: ChatModel, data: p.CompletionRequest, request: Request[Any, Any, Any] | None = None
) -> Started:
    """A completion request checked and mapped, and its generations started."""
    plan = plan_completion(data, state.config, caller_of(request))
    streams = await plan.astart(state, model, completion_prompts(data.prompt))
    return Started(model, plan, streams, sum(s.prompt_tokens for s in streams) // plan.n)
