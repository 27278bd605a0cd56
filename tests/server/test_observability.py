"""Request ids, JSON logs and usage per key, as an operator meets them: ``ortserve serve``
in a process of its own, called with the official SDKs and httpx, its log read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from serving import TINY_MODEL, closing, serve

KEY_A, KEY_B, ADMIN = "sk-alpha-8f3k2", "sk-bravo-d91x0", "sk-admin-55qq"
PROMPT = "a prompt that must never reach a log 4711"


def test_request_ids_tie_responses_errors_and_json_log_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    args = ["--model", f"tiny={TINY_MODEL}", "--api-key", f"team-a={KEY_A}", "--api-key", KEY_B]
    with serve(log, *args, "--log-format", "json", "--state-dir", "none") as url:
        client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0))
        # The client's own id is kept, on the response and in the log line.
        raw = client.chat.completions.with_raw_response.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=4,
            extra_headers={"x-request-id": "client-id-1"},
        )
        assert raw.headers["x-request-id"] == "client-id-1"
        completion = raw.parse()
        # A stream carries one too; an id a client should not have sent is replaced.
        with client.chat.completions.with_streaming_response.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=3,
            stream=True,
            extra_headers={"x-request-id": "bad id\twith spaces"},
        ) as stream:
            streamed_id = stream.headers["x-request-id"]
            assert streamed_id.startswith("req_") and len(streamed_id) == 36
            assert any(line.startswith("data: [DONE]") for line in stream.iter_lines())
        # Errors: the id is in the body as well (the SDKs still parse it), for both API families.
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        body = missing.value.response.json()
        assert body["error"]["code"] == "model_not_found"
        assert body["request_id"] == missing.value.response.headers["x-request-id"]
        claude = closing(anthropic.Anthropic(base_url=url, api_key=KEY_B, max_retries=0))
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model="tiny", max_tokens=-1, messages=[{"role": "user", "content": "x"}])
        assert refused.value.response.json()["request_id"] == refused.value.response.headers["x-request-id"]
        wrong = httpx.post(
            f"{url}/v1/chat/completions", json={}, headers={"authorization": "Bearer wrong", "x-request-id": "r-401"}
        )
        assert wrong.status_code == 401 and wrong.json()["request_id"] == "r-401"
        assert wrong.headers["x-request-id"] == "r-401"
        nowhere = httpx.get(f"{url}/no/such/route", headers={"x-request-id": "r-404"})  # no route's middleware
        assert nowhere.status_code == 404 and nowhere.headers["x-request-id"] == "r-404"
        assert nowhere.json()["request_id"] == "r-404"

    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]  # every line is JSON
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    access = {line["request_id"]: line for line in lines if line["logger"] == "ortserve.access"}
    first = access["client-id-1"]
    assert first["route"] == "/v1/chat/completions" and first["status"] == 200 and first["model"] == "tiny"
    assert first["key"] == "team-a"
    assert first["input_tokens"] == completion.usage.prompt_tokens  # type: ignore[union-attr]
    assert first["output_tokens"] == completion.usage.completion_tokens  # type: ignore[union-attr]
    assert first["duration_ms"] >= first["ttft_ms"] > 0
    # Where the time went, as the runtime timed it: the phases fit in the request.
    assert first["duration_ms"] >= first["queue_ms"] + first["prefill_ms"] + first["decode_ms"]
    assert first["prefill_ms"] > 0 and first["decode_ms"] > 0
    assert access[streamed_id]["output_tokens"] == 3 and access[streamed_id]["key"] == "team-a"
    refused_line = access[refused.value.response.headers["x-request-id"]]
    assert refused_line["status"] == 400 and refused_line["key"].startswith("key-")  # a key without a label
    assert access[missing.value.response.headers["x-request-id"]]["status"] == 404
    assert access["r-401"]["status"] == 401 and access["r-401"]["key"] is None
    text = log.read_text()
    for secret in (KEY_A, KEY_B, PROMPT):  # no key, no prompt, by default
        assert secret not in text


def test_an_error_after_a_stream_started_carries_the_request_id(tiny_url: str) -> None:
    """A schema that compiles but cannot be followed fails after the first chunk went out:
    the error is an event in the stream, with the id the header carries."""
    impossible = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "JSON please"}],
        "max_tokens": 20,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": impossible}},
    }
    with httpx.stream("POST", f"{tiny_url}/v1/chat/completions", json=body) as failing:
        assert failing.status_code == 200
        events = [json.loads(line[6:]) for line in failing.iter_lines() if line.startswith("data: {")]
    assert events[-1]["error"]["type"] == "server_error"
    assert events[-1]["request_id"] == failing.headers["x-request-id"]


def test_log_prompts_puts_the_prompt_into_the_line(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with serve(
        log, "--model", f"tiny={TINY_MODEL}", "--log-format", "json", "--log-prompts", "--state-dir", "none"
    ) as url:
        closing(openai.OpenAI(base_url=f"{url}/v1", api_key="unused")).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2
        )
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert [line["prompt"] for line in lines if line.get("route") == "/v1/chat/completions"] == [PROMPT]


def test_a_plain_log_line_holds_the_path_percent_encoded(tmp_path: Path) -> None:
    """The path is decoded from the request line: a %0A in it wrote a line of the client's
    choosing into a plain log (``INFO ortserve.access: ...``, a forged request)."""
    log = tmp_path / "server.log"
    forged = "INFO ortserve.access: req_forged GET /v1/models 200 model=- tokens=0/0 1ms"
    with serve(log, "--model", f"tiny={TINY_MODEL}", "--log-level", "info", "--state-dir", "none") as url:
        answer = httpx.get(f"{url}/v1/models/x%0A{forged.replace(' ', '%20')}", headers={"x-request-id": "r-path"})
    assert answer.status_code == 404
    lines = log.read_text().splitlines()
    assert not any(line.startswith(forged[:30]) for line in lines), lines
    (line,) = [line for line in lines if "r-path" in line]
    assert "GET /v1/models/x%0AINFO%20ortserve.access:%20req_forged" in line, line


def _usage(url: str, bearer: str, **params: str) -> dict[tuple[str, str], dict[str, int]]:
    answer = httpx.get(f"{url}/v1/usage", params=params, headers={"authorization": f"Bearer {bearer}"})
    assert answer.status_code == 200, answer.text
    return {(row["key"], row["model"]): row for row in answer.json()["data"]}


def test_usage_per_key_is_counted_by_label_and_survives_a_restart(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    args = ["--model", f"tiny={TINY_MODEL}", "--api-key", f"team-a={KEY_A}", "--api-key", f"team-b={KEY_B}"]
    args += ["--admin-key", ADMIN, "--state-dir", str(tmp_path / "state")]
    spent: dict[str, list[int]] = {"team-a": [0, 0], "team-b": [0, 0]}
    with serve(log, *args) as url:
        for key, label, times in ((KEY_A, "team-a", 2), (KEY_B, "team-b", 1)):
            client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0))
            for _ in range(times):
                usage = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
                ).usage
                assert usage is not None
                spent[label][0] += usage.prompt_tokens
                spent[label][1] += usage.completion_tokens
        with pytest.raises(openai.BadRequestError):  # an error, counted as one
            closing(openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0)).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=0
            )
        # The usage of every key is the admin's to read.
        forbidden = httpx.get(f"{url}/v1/usage", headers={"authorization": f"Bearer {KEY_A}"})
        assert forbidden.status_code == 403
        before = _usage(url, ADMIN)
        a, b = before[("team-a", "tiny")], before[("team-b", "tiny")]
        assert (a["requests"], a["errors"], a["input_tokens"], a["output_tokens"]) == (3, 1, *spent["team-a"])
        assert (b["requests"], b["errors"], b["input_tokens"], b["output_tokens"]) == (1, 0, *spent["team-b"])
        metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
        assert 'ortserve_key_requests_total{key="team-a",model="tiny"} 3.0' in metrics
        assert f'ortserve_key_output_tokens_total{{key="team-b",model="tiny"}} {float(spent["team-b"][1])}' in metrics
        # Tenth probe: an API key read every key's usage there, which /v1/usage keeps to the
        # admin key; now it sees the rest of the metrics only.
        theirs = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {KEY_B}"})
        assert theirs.status_code == 200 and 'ortserve_requests_total{endpoint="/v1/chat/completions"' in theirs.text
        assert "ortserve_key_" not in theirs.text.replace("# HELP ortserve_key_", "").replace(
            "# TYPE ortserve_key_", ""
        )
    with serve(log, *args) as url:  # the same state dir: the totals are there
        assert _usage(url, ADMIN) == before
        closing(openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_B, max_retries=0)).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        after = _usage(url, ADMIN, key="team-b")
        assert list(after) == [("team-b", "tiny")] and after[("team-b", "tiny")]["requests"] == 2
        metrics = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
        assert 'ortserve_key_requests_total{key="team-a",model="tiny"} 3.0' in metrics
    for secret in (KEY_A, KEY_B, ADMIN):
        assert secret not in log.read_text()
        assert secret.encode() not in (tmp_path / "state" / "ortserve.db").read_bytes()


def test_without_tracing_configured_no_tracing_code_is_imported(tmp_path: Path) -> None:
    """Tracing off costs nothing: a server that was not asked for traces serves a chat
    (streamed) without ortserve's tracing, OpenTelemetry's SDK or exporter being imported. (Litestar itself imports OpenTelemetry's API and ASGI instrumentation
    when they are installed, to look for its own OpenTelemetry middleware: not ours to stop.)"""
    script = textwrap.dedent(
        f"""
        import sys, httpx
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from serving import running
        from ortserve_server import ServerConfig, create_app
        app = create_app(ServerConfig(models={{"tiny": {str(TINY_MODEL)!r}}}, state_dir=None))
        with running(app) as url:
            body = {{"model": "tiny", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 3, "stream": True}}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200 and answer.headers["x-request-id"]
                assert "[DONE]" in answer.read().decode()
        print(sorted(name for name in sys.modules if name.startswith(("opentelemetry.sdk", "opentelemetry.exporter", "ortserve_server._tracing"))))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_asyncios_line_for_writes_to_a_lost_connection_is_dropped() -> None:
    """Seventeenth probe: 381 "socket.send() raised exception." lines in a 5-minute run where
    clients cut their streams (events already made, written before uvicorn heard of the
    loss, and dropped by the transport). The command's logging leaves that line out, and
    only it."""
    script = textwrap.dedent(
        """
        import logging
        from ortserve_server._cli import _configure_logging
        _configure_logging("warning", "text")
        logging.getLogger("asyncio").warning("socket.send() raised exception.")
        logging.getLogger("asyncio").warning("something else")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert "socket.send()" not in done.stderr and "WARNING asyncio: something else" in done.stderr, done.stderr
