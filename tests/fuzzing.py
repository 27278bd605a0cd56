"""Fuzzing the served API with schemathesis (issue 14): the server under fuzz, the schema it
serves made reachable, and the checks every response must pass. Shared by the bounded test in
the suite (tests/server/test_fuzz.py) and the longer run (tests/fuzz/run_fuzz.py)."""

from __future__ import annotations

import copy
import io
import json
import wave
from pathlib import Path
from typing import Any

import httpx
import schemathesis
from audio import TINY_WHISPER
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from ortserve_server import ServerConfig
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving import TINY_MODEL
from voices import JOE

# The names the fuzz server serves, plus one it does not: a generated ``model`` is drawn from
# these, since a random string is a 404 before any of the interesting work happens.
CHAT_MODEL, SPEECH_MODEL, EMBEDDING_MODEL, RERANK_MODEL, UNKNOWN_MODEL = "tiny", "whisper", "minilm", "ce", "nope"
VOICE_MODEL = "voice"
MODEL_NAMES = [CHAT_MODEL, SPEECH_MODEL, EMBEDDING_MODEL, RERANK_MODEL, VOICE_MODEL, UNKNOWN_MODEL]
CROSS_ENCODER = Path(__file__).resolve().parent / "fixtures" / "tiny-cross-encoder"

# Small bounds so that no generated request is expensive: a fuzzed max_tokens of 10**9 is a 400,
# an absent one generates at most this many tokens; n and prompt lists fan out at most
# max_n times. The tiny models make each generation a few milliseconds.
MAX_TOKENS = 4
MAX_N = 2


def fuzz_config(embedding_folder: Path) -> ServerConfig:
    return ServerConfig(
        models={
            CHAT_MODEL: TINY_MODEL,
            SPEECH_MODEL: TINY_WHISPER,
            EMBEDDING_MODEL: embedding_folder,
            RERANK_MODEL: CROSS_ENCODER,
            VOICE_MODEL: JOE,
        },
        max_tokens_limit=MAX_TOKENS,
        max_n=MAX_N,
        # Generated bodies are small; a lower cap also puts 413 within the fuzzer's reach.
        max_body_size=256 * 1024,
        runtime_adapters=True,  # fuzzed past the 403: names and files are what they check
    )


def reachable(raw: dict[str, Any]) -> dict[str, Any]:
    """The served schema with every request body's ``model`` an enum of the served names (and
    one unknown), since a random string is a 404 before any of the interesting work happens
    (negative cases still get names outside it). Nothing else changes: all other fields are
    fuzzed exactly as documented."""
    schema = copy.deepcopy(raw)
    for name in _MODEL_FOR:
        properties = schema["components"]["schemas"][name]["properties"]
        assert properties["model"] == {"type": "string"}, f"{name}.model changed: {properties['model']}"
        properties["model"] = {"type": "string", "enum": MODEL_NAMES}
    # The served schema documents the upload as ``oneOf: [binary, null]`` (the form field is
    # optional so that a missing file gets OpenAI's 400, not the framework's); schemathesis
    # recognises a file part only by a top-level ``format: binary`` and would otherwise send
    # the audio as a text field without a filename, which never reaches the decoder.
    form = schema["components"]["schemas"]["TranscriptionForm"]["properties"]
    binary = [part for part in form["file"]["oneOf"] if part.get("format") == "binary"]
    assert binary, f"TranscriptionForm.file changed: {form['file']}"
    form["file"] = binary[0]
    return schema


def load(url: str) -> schemathesis.BaseSchema:
    """The schema the server at ``url`` serves, made reachable, with its base URL set."""
    raw = httpx.get(f"{url}/schema/openapi.json", timeout=30).raise_for_status().json()
    schema = schemathesis.openapi.from_dict(reachable(raw))
    schema.config.update(base_url=url)
    schema.hook("flatmap_case")(_steer)
    return schema


def _wav(rate: int, channels: int, width: int, frames: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(width)
        writer.setframerate(rate)
        writer.writeframes(bytes(range(256)) * (frames * channels * width // 256 + 1))
    return buffer.getvalue()


# Real WAV headers with hostile parameters (1 Hz and 4 MHz rates, 8-bit and 32-bit samples,
# 6 channels): random bytes almost never parse as audio, so without these the decoder and
# the resampler would see no fuzzing at all.
_WAVS = st.builds(
    _wav,
    rate=st.sampled_from([1, 7, 8000, 16000, 22050, 48000, 4_000_000]),
    channels=st.sampled_from([1, 2, 6]),
    width=st.sampled_from([1, 2, 3, 4]),
    frames=st.integers(0, 8000),
)


# Which served model each request body is for.
_MODEL_FOR = {
    "ChatCompletionRequest": CHAT_MODEL,
    "CompletionRequest": CHAT_MODEL,
    "TokenizeRequest": CHAT_MODEL,
    "DetokenizeRequest": CHAT_MODEL,
    "EmbeddingRequest": EMBEDDING_MODEL,
    "RerankRequest": RERANK_MODEL,
    "ScoreRequest": RERANK_MODEL,
    "TranscriptionForm": SPEECH_MODEL,
    "MessagesRequest": CHAT_MODEL,
    "CountTokensRequest": CHAT_MODEL,
    "ResponseCreateRequest": CHAT_MODEL,
    "SpeechRequest": VOICE_MODEL,
}
_MODEL_FOR_PATH = {
    "/v1/chat/completions": CHAT_MODEL,
    "/v1/completions": CHAT_MODEL,
    "/v1/tokenize": CHAT_MODEL,
    "/v1/detokenize": CHAT_MODEL,
    "/v1/embeddings": EMBEDDING_MODEL,
    "/v1/rerank": RERANK_MODEL,
    "/v1/score": RERANK_MODEL,
    "/v1/audio/transcriptions": SPEECH_MODEL,
    "/v1/audio/speech": VOICE_MODEL,
    "/v1/messages": CHAT_MODEL,
    "/v1/messages/count_tokens": CHAT_MODEL,
    "/v1/responses": CHAT_MODEL,
    "/v1/models/load": CHAT_MODEL,
    "/v1/models/unload": CHAT_MODEL,
}


def _steer(context: schemathesis.HookContext, case: schemathesis.Case) -> st.SearchStrategy[schemathesis.Case]:
    """flatmap_case: in valid cases, the route's own model three times in four (left to
    itself the generator mostly drew the unknown name, so few requests reached an engine);
    for transcriptions, half the time a real WAV with a supported response_format, since
    random bytes and random text fields are refused before any audio is decoded."""
    if case.path_parameters and "model_id" in case.path_parameters:
        # GET /v1/models/{model_id}: random names (slashes, unicode) half the time, served ones else.
        served = st.sampled_from(MODEL_NAMES).map(lambda name: _with_path(case, name))
        return st.one_of(st.just(case), served)
    right = _MODEL_FOR_PATH.get(case.operation.path)
    body = case.body
    if right is None or not isinstance(body, dict) or case.meta is None or case.meta.generation.mode.is_negative:
        return st.just(case)
    others = [m for m in MODEL_NAMES if m != right]
    model = st.one_of(st.just(right), st.just(right), st.just(right), st.sampled_from(others))
    if right != SPEECH_MODEL:
        return model.map(lambda name: _with_body(case, {**body, "model": name}))
    audio = st.fixed_dictionaries(
        {
            "model": model,
            "file": _WAVS,
            "response_format": st.sampled_from(["json", "text", "verbose_json", "srt", "vtt"]),
            "temperature": st.floats(0, 1),
        }
    )
    generated = model.map(lambda name: {**body, "model": name})
    return st.one_of(generated, audio).map(lambda new: _with_body(case, new))


def _with_path(case: schemathesis.Case, model_id: str) -> schemathesis.Case:
    case.path_parameters = {**(case.path_parameters or {}), "model_id": model_id}
    return case


def _with_body(case: schemathesis.Case, body: dict[str, Any]) -> schemathesis.Case:
    case.body = body
    return case


def openai_error_shape(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """Every 4xx and 5xx body is OpenAI's ``{"error": {"message", "type", "param", "code"}}``,
    since that is what SDKs parse; a framework's own error body would surface as a confusing
    client-side failure."""
    if response.status_code < 400:
        return None
    body = json.loads(response.content)
    error = body.get("error") if isinstance(body, dict) else None
    if case.operation.path.startswith("/v1/messages"):  # Anthropic's routes answer in its shape
        assert isinstance(body, dict) and body.get("type") == "error", f"not Anthropic's error shape: {body}"
        assert isinstance(error, dict) and {"type", "message"} <= set(error), f"not Anthropic's error shape: {body}"
        assert isinstance(error["message"], str) and error["message"], f"empty error message: {body}"
        return None
    assert isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error), (
        f"{response.status_code} body is not OpenAI's error shape: {response.content[:300]!r}"
    )
    assert isinstance(error["message"], str) and error["message"], f"empty error message: {body}"
    return None


# The operations the server serves (GET and POST), as (method, path).
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/v1/rerank"),
    ("POST", "/v1/score"),
    ("POST", "/v1/audio/transcriptions"),
    ("POST", "/v1/audio/speech"),
    ("POST", "/v1/tokenize"),
    ("POST", "/v1/detokenize"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/responses/{response_id}"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("DELETE", "/v1/responses/{response_id}"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/models/load"),
    ("POST", "/v1/models/unload"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/{file_id}"),
    ("GET", "/v1/files/{file_id}/content"),
    ("DELETE", "/v1/files/{file_id}"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/{batch_id}"),
    ("POST", "/v1/batches/{batch_id}/cancel"),
    ("GET", "/v1/usage"),
    ("GET", "/health"),
    ("HEAD", "/health"),
    ("GET", "/metrics"),
    ("HEAD", "/metrics"),
]


def cases() -> list[tuple[str, str, GenerationMode]]:
    """What to fuzz: every operation with valid inputs, and those that take input (the POST
    bodies) with invalid ones too, which must be refused with a 4xx. The GETs' only input is
    a path's model name, which no string can make invalid."""
    modes = {"POST": list(GenerationMode), "GET": [GenerationMode.POSITIVE], "DELETE": [GenerationMode.POSITIVE]}
    modes["HEAD"] = []  # the GET's answer without its body: test_api checks it
    bodiless = {("POST", "/v1/batches/{batch_id}/cancel")}  # nothing there can be made invalid
    return [
        (method, path, mode)
        for method, path in OPERATIONS
        for mode in modes[method]
        if mode == GenerationMode.POSITIVE or (method, path) not in bodiless
    ]


def operations_of(schema: schemathesis.BaseSchema) -> list[tuple[str, str]]:
    return [(op.method.upper(), op.path) for op in (result.ok() for result in schema.get_all_operations())]


def fuzz_settings(max_examples: int, derandomize: bool = True) -> Any:
    """Hypothesis settings for a fuzz run: no deadline, since timing on a shared machine is
    no verdict (the server's own limits are what bound the work); health checks off, since
    slow generation of big bodies is expected here; derandomized in CI so that a failure
    reproduces, random (or ``hypothesis.seed``) in the longer run."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=derandomize,
        suppress_health_check=list(HealthCheck),
        database=None,
        print_blob=True,
    )


def validate(case: schemathesis.Case, response: schemathesis.Response) -> None:
    """Run every check on ``response``; raises with schemathesis's report (and a curl
    reproducer) on the first failure."""
    case.validate_response(response, checks=CHECKS)


def documented_body(ctx: Any, response: schemathesis.Response, case: schemathesis.Case) -> bool | None:
    """A JSON body matches its documented schema. A stream is documented as text (OpenAPI
    3.1 has no schema per server-sent event), which schemathesis would check event by event
    as if it were OpenAPI 3.2's ``itemSchema``: each of its ``data:`` lines must be a JSON
    object, or ``[DONE]``, instead."""
    if not response.headers.get("content-type", [""])[0].startswith("text/event-stream"):
        return response_schema_conformance(ctx, response, case)
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            assert isinstance(json.loads(line.removeprefix("data: ")), dict), f"not a JSON event: {line[:200]}"
    return None


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    documented_body,
    openai_error_shape,
]
