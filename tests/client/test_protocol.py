"""The wire protocol: OpenAI-shaped JSON decodes (unknown fields tolerated, absent apart
from null), and responses encode to exactly the keys OpenAI sends."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from ortserve_client import protocol as p


def encode(value: msgspec.Struct) -> Any:
    return json.loads(msgspec.json.encode(value))


def test_public_names() -> None:
    assert set(p.__all__) <= set(dir(p))
    assert {"ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "ErrorResponse", "UNSET"} <= set(
        p.__all__
    )


def test_chat_request_from_an_sdk_decodes_with_unknown_fields() -> None:
    raw = {
        "model": "m",
        "messages": [
            {"role": "developer", "content": "rules"},
            {"role": "system", "content": [{"type": "text", "text": "be brief"}], "name": "sys"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detail": "low"}},
                    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                ],
                "some_new_message_field": 1,
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
        "max_completion_tokens": 9,
        "temperature": None,
        "top_k": 5,
        "repetition_penalty": 1.1,
        "min_tokens": 2,
        "stop": "END",
        "stream": True,
        "stream_options": {"include_usage": True},
        "logit_bias": {"50256": -100},
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}, "strict": True},
            }
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
        "guided_choice": ["yes", "no"],
        "metadata": {"from": "a newer SDK"},
        "store": False,
    }
    request = msgspec.json.decode(json.dumps(raw), type=p.ChatCompletionRequest)
    developer, system, user, assistant, tool = request.messages
    assert isinstance(developer, p.DeveloperMessage) and developer.content == "rules"
    assert isinstance(system, p.SystemMessage) and system.content == [p.TextContentPart(text="be brief")]
    assert isinstance(user, p.UserMessage) and isinstance(user.content, list)
    text, image, audio = user.content
    assert isinstance(text, p.TextContentPart)
    assert isinstance(image, p.ImageContentPart) and image.image_url.detail == "low"
    assert isinstance(audio, p.InputAudioContentPart) and audio.input_audio.format == "wav"
    assert isinstance(assistant, p.AssistantMessage) and assistant.content is None
    assert assistant.tool_calls == [p.ToolCall(id="c1", function=p.FunctionCall(name="f", arguments="{}"))]
    assert isinstance(tool, p.ToolMessage) and tool.tool_call_id == "c1"
    assert request.temperature is None  # sent as null
    assert request.top_p is msgspec.UNSET  # not sent at all
    assert request.stop == "END"
    assert request.stream_options == p.StreamOptions(include_usage=True)
    assert request.tools == [
        p.Tool(function=p.FunctionDefinition(name="f", description="d", parameters={"type": "object"}, strict=True))
    ]
    assert request.tool_choice == "auto"
    assert isinstance(request.response_format, p.ResponseFormatJSONObject)
    assert request.guided_choice == ["yes", "no"]
    assert (request.top_k, request.repetition_penalty, request.min_tokens) == (5, 1.1, 2)


def test_request_encoding_omits_absent_fields_and_keeps_nulls() -> None:
    raw = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"seed":null,"n":2,"unknown":[1]}'
    request = msgspec.json.decode(raw, type=p.ChatCompletionRequest)
    assert encode(request) == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": None, "n": 2}


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ("none", "none"),
        ("required", "required"),
        (
            {"type": "function", "function": {"name": "f"}},
            p.NamedToolChoice(function=p.NamedToolChoiceFunction(name="f")),
        ),
    ],
)
def test_tool_choice(choice: object, expected: object) -> None:
    raw = json.dumps({"model": "m", "messages": [], "tool_choice": choice})
    assert msgspec.json.decode(raw, type=p.ChatCompletionRequest).tool_choice == expected


def test_response_format_json_schema() -> None:
    raw = {
        "model": "m",
        "messages": [],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True},
        },
    }
    request = msgspec.json.decode(json.dumps(raw), type=p.ChatCompletionRequest)
    assert request.response_format == p.ResponseFormatJSONSchema(
        json_schema=p.JSONSchema(name="city", schema={"type": "object"}, strict=True)
    )
    assert encode(request)["response_format"] == raw["response_format"]


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "$.messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "$.messages[0].content[0].type",
        ),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "$.messages[0]"),  # no tool_call_id
        ({"model": "m", "messages": [], "max_tokens": "5"}, "$.max_tokens"),
        ({"model": "m", "messages": [], "tool_choice": "sometimes"}, "$.tool_choice"),
        ({"messages": []}, "model"),
    ],
)
def test_validation_errors_name_the_field(raw: dict[str, Any], path: str) -> None:
    with pytest.raises(msgspec.ValidationError) as info:
        msgspec.json.decode(json.dumps(raw), type=p.ChatCompletionRequest)
    assert path in str(info.value)


@pytest.mark.parametrize("value", ["one", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_prompt_and_input_shapes(value: object) -> None:
    completion = msgspec.json.decode(
        json.dumps({"model": "m", "prompt": value, "echo": True}), type=p.CompletionRequest
    )
    assert completion.prompt == value and completion.echo is True
    embedding = msgspec.json.decode(json.dumps({"model": "m", "input": value}), type=p.EmbeddingRequest)
    assert embedding.input == value
    assert encode(embedding) == {"model": "m", "input": value}


def test_embedding_request_extensions() -> None:
    raw = {"model": "e", "input": "x", "encoding_format": "base64", "dimensions": 8, "truncate": False, "user": "u"}
    request = msgspec.json.decode(json.dumps(raw), type=p.EmbeddingRequest)
    assert (request.encoding_format, request.dimensions, request.truncate) == ("base64", 8, False)
    assert encode(request) == raw


def test_tokenize_requests() -> None:
    by_prompt = msgspec.json.decode(b'{"model":"m","prompt":"hi"}', type=p.TokenizeRequest)
    assert by_prompt.messages is msgspec.UNSET and by_prompt.add_generation_prompt is msgspec.UNSET
    by_chat = msgspec.json.decode(
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}',
        type=p.TokenizeRequest,
    )
    assert by_chat.prompt is msgspec.UNSET and by_chat.messages == [p.UserMessage(content="hi")]
    detok = msgspec.json.decode(b'{"model":"m","tokens":[1,2]}', type=p.DetokenizeRequest)
    assert detok == p.DetokenizeRequest(model="m", tokens=[1, 2])


def test_chat_completion_encodes_exactly_like_openai() -> None:
    completion = p.ChatCompletion(
        id="chatcmpl-1",
        created=1700000000,
        model="m",
        choices=[
            p.ChatCompletionChoice(
                index=0,
                message=p.ChatCompletionMessage(
                    tool_calls=[p.ToolCall(id="call_1", function=p.FunctionCall(name="f", arguments='{"a":1}'))]
                ),
                finish_reason="tool_calls",
            )
        ],
        usage=p.CompletionUsage(prompt_tokens=3, completion_tokens=4, total_tokens=7),
    )
    assert encode(completion) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
                    ],
                },
                "finish_reason": "tool_calls",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": 4,
            "total_tokens": 7,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "system_fingerprint": None,
    }
    plain = p.ChatCompletionMessage(content="hi")
    assert encode(plain) == {"role": "assistant", "content": "hi", "refusal": None}


def test_a_response_from_another_server_decodes() -> None:
    """Unknown fields, and log-probabilities without the fields OpenAI sends too, do not
    break the client."""
    raw = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "gpt",
        "service_tier": "default",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", "refusal": None, "annotations": []},
                "finish_reason": "stop",
                "logprobs": {"content": [{"token": "hi", "logprob": -0.1}]},
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": {}},
    }
    completion = msgspec.json.decode(json.dumps(raw), type=p.ChatCompletion)
    assert completion.choices[0].logprobs == p.ChoiceLogprobs(
        content=[p.ChatCompletionTokenLogprob(token="hi", logprob=-0.1)]
    )
    assert completion.usage == p.CompletionUsage(
        prompt_tokens=1, completion_tokens=1, total_tokens=2, prompt_tokens_details=p.PromptTokensDetails()
    )


def test_chunks_encode_exactly_like_openai() -> None:
    first = p.ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(role="assistant", content=""))],
    )
    assert encode(first) == {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
        ],
        "usage": None,
        "system_fingerprint": None,
    }
    tool_start = p.ChoiceDelta(
        tool_calls=[
            p.ChoiceDeltaToolCall(
                index=0, id="call_1", type="function", function=p.ChoiceDeltaFunctionCall(name="f", arguments="")
            )
        ]
    )
    tool_more = p.ChoiceDelta(
        tool_calls=[p.ChoiceDeltaToolCall(index=0, function=p.ChoiceDeltaFunctionCall(arguments='{"a"'))]
    )
    assert encode(tool_start) == {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]
    }
    assert encode(tool_more) == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    last = p.ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[],
        usage=p.CompletionUsage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    )
    assert encode(last)["choices"] == [] and encode(last)["usage"]["total_tokens"] == 3
    finish = p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(), finish_reason="stop")
    assert encode(finish) == {"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None}


def test_logprobs_encode_exactly_like_openai() -> None:
    top = p.TopLogprob(token="hi", logprob=-0.25, bytes=[104, 105])
    chat = p.ChoiceLogprobs(
        content=[p.ChatCompletionTokenLogprob(token="hi", logprob=-0.25, bytes=[104, 105], top_logprobs=[top])]
    )
    assert encode(chat) == {
        "content": [
            {
                "token": "hi",
                "logprob": -0.25,
                "bytes": [104, 105],
                "top_logprobs": [{"token": "hi", "logprob": -0.25, "bytes": [104, 105]}],
            }
        ],
        "refusal": None,
    }
    legacy = p.CompletionLogprobs(
        tokens=["a", "b"],
        token_logprobs=[-0.5, -1.0],
        top_logprobs=[{"a": -0.5}, {"b": -1.0, "c": -2.0}],
        text_offset=[0, 1],
    )
    assert encode(legacy) == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -1.0],
        "top_logprobs": [{"a": -0.5}, {"b": -1.0, "c": -2.0}],
        "text_offset": [0, 1],
    }


def test_text_completion_embeddings_models_and_errors_encode_like_openai() -> None:
    completion = p.Completion(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[p.CompletionChoice(index=0, text="abc", finish_reason="length")],
        usage=p.CompletionUsage(prompt_tokens=1, completion_tokens=3, total_tokens=4),
    )
    assert encode(completion) == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": "abc", "finish_reason": "length", "logprobs": None}],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": 3,
            "total_tokens": 4,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "system_fingerprint": None,
    }
    embeddings = p.CreateEmbeddingResponse(
        data=[p.Embedding(index=0, embedding=[0.5])],
        model="e",
        usage=p.EmbeddingUsage(prompt_tokens=2, total_tokens=2),
    )
    assert encode(embeddings) == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
        "model": "e",
        "usage": {"prompt_tokens": 2, "total_tokens": 2},
    }
    models = p.ModelList(data=[p.Model(id="m", created=1, owned_by="ortserve", provider="cuda", engine="og-engine")])
    assert encode(models) == {
        "object": "list",
        "data": [
            {
                "id": "m",
                "object": "model",
                "created": 1,
                "owned_by": "ortserve",
                "kind": None,
                "status": None,
                "progress": None,
                "provider": "cuda",
                "engine": "og-engine",
                "engine_reason": None,
                "prefill_int8": None,
                "kv_cache_dtype": None,
                "reproducible": None,
                "input_modalities": None,
                "tool_format": None,
                "reasoning": None,
                "speculative": None,
                "draft_tokens": None,
                "draft_acceptance_rate": None,
                "tools_in_system_prompt": None,
                "parent": None,
                "root": None,
                "error": None,
                "in_flight": None,
                "last_used": None,
                "resident_bytes": None,
                "kv_cache_bytes": None,
                "expires_at": None,
                "voices": None,
            }
        ],
    }
    error = p.ErrorResponse(error=p.ErrorDetail(message="no such model", type="invalid_request_error", param="model"))
    assert encode(error) == {
        "error": {"message": "no such model", "type": "invalid_request_error", "param": "model", "code": None}
    }
    assert encode(p.TokenizeResponse(tokens=[1], count=1, max_model_len=8)) == {
        "tokens": [1],
        "count": 1,
        "max_model_len": 8,
    }
    assert encode(p.DetokenizeResponse(prompt="a")) == {"prompt": "a"}
    health = p.Health(status="loading", models=[p.HealthModel(id="m", status="loading", provider="cpu")])
    assert encode(health) == {
        "status": "loading",
        "models": [{"id": "m", "status": "loading", "provider": "cpu", "engine": None}],
    }


def test_the_openai_sdk_reads_what_we_encode() -> None:
    """Cross-check with the official SDK's own (pydantic) types."""
    openai_types = pytest.importorskip("openai.types")
    chunk_types = pytest.importorskip("openai.types.chat")
    completion = p.ChatCompletion(
        id="c",
        created=1,
        model="m",
        choices=[
            p.ChatCompletionChoice(
                index=0,
                message=p.ChatCompletionMessage(
                    tool_calls=[p.ToolCall(id="t", function=p.FunctionCall(name="f", arguments="{}"))]
                ),
                finish_reason="tool_calls",
            )
        ],
        usage=p.CompletionUsage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )
    parsed = chunk_types.ChatCompletion.model_validate_json(msgspec.json.encode(completion))
    assert parsed.choices[0].message.tool_calls[0].function.name == "f"
    assert parsed.choices[0].message.content is None
    chunk = p.ChatCompletionChunk(
        id="c",
        created=1,
        model="m",
        choices=[p.ChatCompletionChunkChoice(index=0, delta=p.ChoiceDelta(content="x"))],
    )
    assert (
        chunk_types.ChatCompletionChunk.model_validate_json(msgspec.json.encode(chunk)).choices[0].delta.content == "x"
    )
    text = p.Completion(
        id="c", created=1, model="m", choices=[p.CompletionChoice(index=0, text="t", finish_reason="stop")]
    )
    assert openai_types.Completion.model_validate_json(msgspec.json.encode(text)).choices[0].text == "t"
    embeddings = p.CreateEmbeddingResponse(
        data=[p.Embedding(index=0, embedding=[1.0])], model="e", usage=p.EmbeddingUsage(prompt_tokens=1, total_tokens=1)
    )
    parsed_embeddings = openai_types.CreateEmbeddingResponse.model_validate_json(msgspec.json.encode(embeddings))
    assert parsed_embeddings.data[0].embedding == [1.0]
    assert (
        openai_types.Model.model_validate_json(msgspec.json.encode(p.Model(id="m", created=1, owned_by="o"))).id == "m"
    )


def test_media_parts_from_bytes() -> None:
    image = p.ImageContentPart.from_bytes(b"\x89PNG", "image/png")
    audio = p.InputAudioContentPart.from_bytes(b"RIFF", "wav")
    assert msgspec.json.decode(msgspec.json.encode([image, audio])) == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw=="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ]
