"""Two `ortserve serve` processes sharing one PostgreSQL (`--state-url`), a real server
started by the test: a response chain made on one continues on the other, and a batch
whose server is killed (SIGKILL) halfway is finished by the other, every line answered
exactly once."""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from postgres import postgres_server
from test_batches import _client, _jsonl, _lines, _short_line, _wait
from test_connections import serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def state_url() -> Iterator[str]:
    with postgres_server() as url:
        yield url


def test_a_chain_continues_on_another_replica(state_url: str) -> None:
    with (
        serving("--state-url", state_url) as (_, first_url),
        serving("--state-url", state_url) as (_, second_url),
        _client(first_url) as first,
        _client(second_url) as second,
    ):
        made = first.responses.create(model="tiny", input="Remember heliotrope.", max_output_tokens=3, store=True)
        kept = second.responses.retrieve(made.id)
        assert kept.output_text == made.output_text
        follow = second.responses.create(
            model="tiny", input="Which word?", previous_response_id=made.id, max_output_tokens=3, store=True
        )
        assert follow.usage is not None and made.usage is not None
        assert follow.usage.input_tokens > made.usage.input_tokens
        assert first.responses.retrieve(follow.id).id == follow.id
        second.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError):
            first.responses.retrieve(made.id)


def test_a_batch_moves_to_the_other_replica_when_its_server_dies(state_url: str) -> None:
    count = 1000
    lines = [_short_line(i) for i in range(count)]
    with (
        serving("--state-url", state_url) as (survivor, second_url),
        _client(second_url) as second,
        serving("--state-url", state_url) as (doomed, first_url),
        _client(first_url) as first,
    ):
        uploaded = first.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
        batch = first.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        while (seen := second.batches.retrieve(batch.id)).request_counts.completed < count // 3:  # type: ignore[union-attr]
            assert seen.status in ("validating", "in_progress"), seen
            time.sleep(0.02)
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(timeout=30)
        done = _wait(second, batch.id, within=300)
        assert survivor.poll() is None
    assert done.status == "completed"
    assert done.request_counts is not None and done.request_counts.completed == count
    with serving("--state-url", state_url) as (_, url), _client(url) as client:
        answered = _lines(client, done.output_file_id)
    assert [line["custom_id"] for line in answered] == [f"line-{i}" for i in range(count)]
    assert all(json.dumps(line["response"]["body"]["usage"]) for line in answered)


def test_usage_per_key_adds_up_over_the_replicas(state_url: str) -> None:
    """Each replica adds its counts to the shared database; ``GET /v1/usage`` reads the sum."""
    keys = ("--api-key", "team-shared=sk-shared-7q", "--admin-key", "sk-admin-7q")
    with (
        serving("--state-url", state_url, *keys) as (_, first_url),
        serving("--state-url", state_url, *keys) as (
            _,
            second_url,
        ),
    ):
        spent = 0
        for url in (first_url, second_url, second_url):
            with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-shared-7q", max_retries=0) as client:
                usage = client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                ).usage
                assert usage is not None
                spent += usage.completion_tokens
        deadline = time.monotonic() + 10  # the other replica writes its counts every 2 s
        while True:
            rows = httpx.get(
                f"{first_url}/v1/usage",
                params={"key": "team-shared"},  # the database is the module's: other tests' usage is there too
                headers={"authorization": "Bearer sk-admin-7q"},
            ).json()["data"]
            found = [(r["key"], r["model"], r["requests"], r["output_tokens"]) for r in rows]
            if found == [("team-shared", "tiny", 3, spent)] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert found == [("team-shared", "tiny", 3, spent)]
