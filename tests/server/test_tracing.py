"""OpenTelemetry traces as operators meet them: ``ortserve serve --otlp-endpoint`` exporting
to a real OTLP/HTTP receiver started here (protobuf decoded with opentelemetry-proto), and a
FastAPI host with OpenTelemetry's ASGI instrumentation that mounts ortserve and sees its
spans inside its own request span."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from otlp_receiver import Receiver, Span, otlp_receiver
from serving import TINY_MODEL, closing, serve
from voices import quiet_voice

TOOLS_SERVER = Path(__file__).resolve().parent.parent / "mcp_tools_server.py"
SERVER, INTERNAL = 2, 1  # the protobuf's SpanKind values (SPAN_KIND_SERVER, SPAN_KIND_INTERNAL)


def _traceparent() -> tuple[str, str, str]:
    """A client's own trace: (traceparent header, trace id, span id)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Receiver]]:
    """A server exporting its traces to a receiver of the test's own, with an MCP server."""
    folder = tmp_path_factory.mktemp("traced")
    tools = f"tools=stdio:{sys.executable} {TOOLS_SERVER} stdio {folder / 'nap'}"
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "llm-under-test"}
    with otlp_receiver() as (endpoint, receiver):
        voice = quiet_voice(folder / "joe")
        args = [
            "--model",
            f"tiny={TINY_MODEL}",
            "--model",
            f"joe={voice}",
            "--mcp-server",
            tools,
            "--state-dir",
            "none",
        ]
        with serve(folder / "server.log", *args, "--otlp-endpoint", endpoint, env=env) as url:
            yield url, receiver


def _in(trace_id: str, *names: str) -> Any:
    def ready(spans: list[Span]) -> bool:
        found = {s.name for s in spans if s.trace_id == trace_id}
        return all(name in found for name in names)

    return ready


def _one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


def test_a_streamed_chat_is_a_span_per_phase_under_the_clients_traceparent(traced: tuple[str, Receiver]) -> None:
    url, receiver = traced
    header, trace_id, client_span = _traceparent()
    client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    with client.chat.completions.with_streaming_response.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        stream=True,
        extra_headers={"traceparent": header},
    ) as answer:
        request_id = answer.headers["x-request-id"]
        chunks = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
    spans = [
        s
        for s in receiver.wait_for(_in(trace_id, "chat tiny", "prepare_prompt", "queue_wait", "prefill", "decode"))
        if s.trace_id == trace_id
    ]
    request = _one(spans, "chat tiny")
    assert request.parent_id == client_span and request.kind == SERVER
    assert request.service == "llm-under-test"
    attributes = request.attributes
    assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == "tiny"
    assert attributes["gen_ai.response.id"] == chunks[0]["id"]
    assert attributes["gen_ai.response.finish_reasons"] == [chunks[-1]["choices"][0]["finish_reason"]]
    assert attributes["gen_ai.usage.output_tokens"] == 5 and attributes["gen_ai.usage.input_tokens"] > 0
    assert attributes["ortserve.request_id"] == request_id  # response, span (and log line) share it
    assert attributes["http.response.status_code"] == 200 and attributes["http.route"] == "/v1/chat/completions"
    phases = {name: _one(spans, name) for name in ("prepare_prompt", "queue_wait", "prefill", "decode")}
    assert all(p.parent_id == request.span_id for p in phases.values())
    # In order, inside the request's span (the phases' times come from the runtime's clock).
    order = [phases[name] for name in ("prepare_prompt", "queue_wait", "prefill", "decode")]
    slack = 2_000_000  # 2 ms: the runtime's stamps and the span's start are read apart
    assert request.start <= order[0].start and order[-1].end <= request.end + slack
    for before, after in itertools.pairwise(order):
        assert before.end <= after.start + slack
    assert phases["prefill"].attributes["gen_ai.usage.input_tokens"] == attributes["gen_ai.usage.input_tokens"]
    assert "gen_ai.usage.cache_read.input_tokens" in phases["prefill"].attributes
    decode = phases["decode"].attributes
    assert decode["gen_ai.usage.output_tokens"] == 5 and decode["ortserve.decode.tokens_per_second"] > 0


def test_a_tool_loops_turns_and_mcp_calls_are_spans(traced: tuple[str, Receiver]) -> None:
    url, receiver = traced
    header, trace_id, client_span = _traceparent()
    client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    tools: Any = [
        {
            "type": "mcp",
            "server_label": "tools",
            "server_url": "https://unused.example/mcp",
            "require_approval": "never",
        }
    ]
    response = client.responses.create(
        model="tiny",
        input="Add two numbers",
        tools=tools,
        tool_choice={"type": "mcp", "server_label": "tools", "name": "add"},  # type: ignore[arg-type]
        max_tool_calls=1,
        max_output_tokens=40,
        extra_headers={"traceparent": header},
    )
    assert any(item.type == "mcp_call" for item in response.output)
    spans = [
        s
        for s in receiver.wait_for(_in(trace_id, "chat tiny", "turn 1", "turn 2", "execute_tool add"))
        if s.trace_id == trace_id
    ]
    request = _one(spans, "chat tiny")
    assert request.parent_id == client_span and request.attributes["gen_ai.response.id"] == response.id
    call = _one(spans, "execute_tool add")
    assert call.parent_id == request.span_id
    assert call.attributes["gen_ai.tool.name"] == "add" and call.attributes["gen_ai.operation.name"] == "execute_tool"
    turns = [_one(spans, "turn 1"), _one(spans, "turn 2")]
    assert all(turn.parent_id == request.span_id for turn in turns)
    assert turns[0].end <= call.start and call.end <= turns[1].start  # the call runs between the turns
    for turn in turns:  # each turn's generation phases sit under it
        assert {s.name for s in spans if s.parent_id == turn.span_id} == {"queue_wait", "prefill", "decode"}


def test_a_batch_line_continues_the_trace_of_the_request_that_created_the_batch(
    traced: tuple[str, Receiver],
) -> None:
    url, receiver = traced
    header, trace_id, client_span = _traceparent()
    client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    line = {
        "custom_id": "one",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    }
    upload = client.files.create(file=("in.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        extra_headers={"traceparent": header},
    )
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline and batch.status in ("validating", "in_progress", "finalizing"), batch
        time.sleep(0.1)
    assert batch.output_file_id is not None
    output = json.loads(client.files.content(batch.output_file_id).text)
    spans = [s for s in receiver.wait_for(_in(trace_id, "POST /v1/batches", "chat tiny")) if s.trace_id == trace_id]
    created = _one(spans, "POST /v1/batches")
    assert created.parent_id == client_span
    line_span = _one(spans, "chat tiny")
    assert line_span.parent_id == created.span_id
    assert line_span.attributes["ortserve.request_id"] == output["response"]["request_id"]
    assert {s.name for s in spans if s.parent_id == line_span.span_id} >= {"queue_wait", "prefill", "decode"}


def test_speech_is_a_span_per_sentence(traced: tuple[str, Receiver]) -> None:
    url, receiver = traced
    header, trace_id, client_span = _traceparent()
    client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0))
    audio = client.audio.speech.create(
        model="joe", voice="joe", input="Hello there. How are you today?", extra_headers={"traceparent": header}
    )
    assert audio.content
    spans = [s for s in receiver.wait_for(_in(trace_id, "POST /v1/audio/speech")) if s.trace_id == trace_id]
    request = _one(spans, "POST /v1/audio/speech")
    assert request.parent_id == client_span and request.attributes["ortserve.request_id"]
    sentences = sorted((s for s in spans if s.name == "speech_sentence"), key=lambda s: s.start)
    assert [s.attributes["ortserve.sentence"] for s in sentences] == [1, 2]
    assert all(s.parent_id == request.span_id and s.attributes["ortserve.audio_seconds"] > 0 for s in sentences)


HOST = textwrap.dedent(
    """
    import contextlib, sys
    import httpx
    from fastapi import FastAPI
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    sys.path.insert(0, sys.argv[3])
    from serving import running
    from ortserve_server import ServerConfig, create_app, lifespan

    provider = TracerProvider(resource=Resource.create({"service.name": "host-app"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1] + "/v1/traces")))
    trace.set_tracer_provider(provider)  # the host's own tracing; ortserve finds and joins it

    llm = create_app(ServerConfig(models={"tiny": sys.argv[2]}, state_dir=None))

    @contextlib.asynccontextmanager
    async def host_lifespan(app):
        async with lifespan(llm):  # Starlette does not run a mounted app's lifespan
            yield

    app = FastAPI(lifespan=host_lifespan)
    app.mount("/llm", llm)

    with running(OpenTelemetryMiddleware(app)) as url:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url + "/llm/v1/chat/completions", json=body) as answer:
            assert answer.status_code == 200
            answer.read()
            print(answer.headers["x-request-id"])
    provider.shutdown()
    """
)


def test_a_fastapi_host_with_asgi_instrumentation_sees_ortserves_spans_inside_its_own() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    with otlp_receiver() as (endpoint, receiver):
        done = subprocess.run(
            [sys.executable, "-c", HOST, endpoint, str(TINY_MODEL), str(Path(__file__).resolve().parent.parent)],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        request_id = done.stdout.strip().splitlines()[-1]
        spans = receiver.wait_for(lambda found: any(s.name == "chat tiny" for s in found))
    # The host's request span (OpenTelemetryMiddleware's; recent FastAPI versions open one of
    # their own inside it too): ortserve's span is a child of it, not a server span of its own.
    host = {s.span_id: s for s in spans if s.kind == SERVER}
    assert host and all(s.service == "host-app" for s in host.values())
    ours = _one(spans, "chat tiny")
    assert ours.kind == INTERNAL and ours.parent_id in host and ours.trace_id == host[ours.parent_id].trace_id
    assert host[ours.parent_id].start <= ours.start
    assert ours.service == "host-app" and ours.attributes["ortserve.request_id"] == request_id
    assert ours.attributes["gen_ai.usage.output_tokens"] == 4
    phases = {s.name for s in spans if s.parent_id == ours.span_id}
    assert phases >= {"prepare_prompt", "queue_wait", "prefill", "decode"}
