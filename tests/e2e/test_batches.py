"""The Files and Batch APIs through the openai SDK against real `ortserve serve` processes:
uploads checked line by line, batches over every endpoint, cancellation, owners kept apart,
and a batch that survives SIGKILL with every line answered exactly once."""

from __future__ import annotations

import io
import json
import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_connections import serving, stopped_log


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """One server (and client) for the tests that need nothing of their own."""
    with serving("--state-dir", str(tmp_path_factory.mktemp("state"))) as (_, url), _client(url) as client:
        yield client


def _client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _chat_line(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"line-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"Count to {i}."}],
            "max_tokens": 3,
            "temperature": 0,
            **body,
        },
    }


def _short_line(i: int) -> dict[str, Any]:
    """A line that costs the engine little (a few prompt tokens, one new token): the tests
    of many lines are about the batch's bookkeeping, not the model."""
    return {
        "custom_id": f"line-{i}",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": f"{i}", "max_tokens": 1, "temperature": 0},
    }


def _wait(client: openai.OpenAI, batch_id: str, within: float = 120) -> Any:
    end = time.monotonic() + within
    while time.monotonic() < end:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.1)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {within} s")


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_through_the_sdk(shared: openai.OpenAI) -> None:
    lines = [_chat_line(i) for i in range(6)]
    lines.append(_chat_line(6, model="no-such-model"))
    client = shared
    uploaded = client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(lines))), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(_jsonl(lines))
    assert client.files.retrieve(uploaded.id).filename == "in.jsonl"
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "test"},
    )
    assert batch.status == "validating" and batch.metadata == {"job": "test"}
    done = _wait(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 6, 1)
    output = _lines(client, done.output_file_id)
    errors = _lines(client, done.error_file_id)
    assert [line["custom_id"] for line in output] == [f"line-{i}" for i in range(6)]
    direct = client.chat.completions.create(**lines[2]["body"])
    assert output[2]["response"]["status_code"] == 200
    assert output[2]["response"]["body"]["choices"][0]["message"]["content"] == direct.choices[0].message.content
    assert errors[0]["custom_id"] == "line-6"
    assert errors[0]["response"]["status_code"] == 404
    assert errors[0]["response"]["body"]["error"]["param"] == "model"
    assert batch.id in {b.id for b in client.batches.list().data}
    listed = {f.id for f in client.files.list(purpose="batch_output").data}
    assert {done.output_file_id, done.error_file_id} <= listed and uploaded.id not in listed
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_every_endpoint_runs_in_a_batch(shared: openai.OpenAI) -> None:
    bodies = {
        "/v1/completions": {"model": "tiny", "prompt": "Once", "max_tokens": 2},
        "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": 2},
    }
    client = shared
    for endpoint, body in bodies.items():
        line = {"custom_id": "a", "method": "POST", "url": endpoint, "body": body}
        uploaded = client.files.create(file=("in.jsonl", _jsonl([line])), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]
        done = _wait(client, batch.id)
        (answer,) = _lines(client, done.output_file_id)
        assert answer["response"]["status_code"] == 200, answer
        assert answer["response"]["body"]["usage"], answer


def test_lines_with_answers_of_megabytes_are_answered(shared: openai.OpenAI) -> None:
    """Issue 45, seventh probe: an answer past 1 MiB is streamed to the client in pieces
    (json_answer), and the runner's receive() then raised CancelledError (the future it
    awaited was cancelled with the route's disconnect watch): each line was cancelled, run
    again, and cancelled again, the batch never ended, and /health stalled up to 164 ms."""
    big = {"n": 8, "max_tokens": 150, "min_tokens": 150, "logprobs": True, "top_logprobs": 20}
    lines = [_chat_line(i, **big) for i in range(2)]
    client = shared
    uploaded = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = _wait(client, batch.id, within=60)
    assert done.request_counts is not None and done.request_counts.completed == 2, done.request_counts
    output = _lines(client, done.output_file_id)
    body = dict(lines[1]["body"])
    extra = {"min_tokens": body.pop("min_tokens")}
    direct = client.chat.completions.create(**body, extra_body=extra)
    answer = output[1]["response"]["body"]
    assert len(json.dumps(answer)) > 1 << 20  # past one piece of json_answer
    assert [c["message"]["content"] for c in answer["choices"]] == [c.message.content for c in direct.choices]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "line 2: "),
        (json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/rerank", "body": {}}), "line 2: url '/v1/rerank'"),
        (json.dumps(_chat_line(0)), "line 2: custom_id 'line-0' is used twice"),
        (json.dumps(_chat_line(5, stream=True)), "line 2: body.stream"),
        (json.dumps(_chat_line(5, messages="hi")), "line 2: body: Expected `array`"),
    ],
)
def test_a_bad_line_is_refused_by_number(shared: openai.OpenAI, line: str, says: str) -> None:
    content = json.dumps(_chat_line(0)).encode() + b"\n" + line.encode() + b"\n"
    client = shared
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("in.jsonl", content), purpose="batch")
    assert says in caught.value.message
    assert caught.value.body["param"] == "file"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("in.jsonl", content), purpose="fine-tune")
    assert client.models.list().data  # still serving


def test_batch_metadata_has_openais_bounds(shared: openai.OpenAI) -> None:
    """Issue 45: a batch kept any metadata (20,000 pairs, a 1 MB value) with itself."""
    uploaded = shared.files.create(file=("in.jsonl", _jsonl([_chat_line(1)])), purpose="batch")
    for metadata in ({str(i): "v" for i in range(17)}, {"k": "v" * 513}, {"k" * 65: "v"}):
        with pytest.raises(openai.BadRequestError) as caught:
            shared.batches.create(
                input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata=metadata
            )
        assert caught.value.body["param"] == "metadata", caught.value.body  # type: ignore[index]
    most = {str(i): "v" * 512 for i in range(16)}
    made = shared.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata=most
    )
    assert shared.batches.retrieve(made.id).metadata == most


@pytest.mark.parametrize("limit", [-1, 0, 101])
def test_a_list_limit_out_of_range_is_refused(shared: openai.OpenAI, limit: int) -> None:
    """Issue 45: the batch list clamped its limit (-1 and 0 listed one batch, 10**23 a
    hundred) where the file list refuses one outside its range."""
    with pytest.raises(openai.BadRequestError) as caught:
        shared.batches.list(limit=limit)
    assert caught.value.body["param"] == "limit", caught.value.body  # type: ignore[index]
    assert "between 1 and 100" in caught.value.body["message"]  # type: ignore[index]


def test_a_line_past_ten_megabytes_runs_as_the_same_request_alone(shared: openai.OpenAI) -> None:
    """Twenty-fifth probe, issue 45: a line of 10-16 MB passed the upload's bound (the
    server's max_body_size, 16 MiB) and then failed every time with a 413 from the runner's
    own, Litestar's 10 MB. It is answered as the same request sent alone is."""
    client = shared
    line = _chat_line(0, messages=[{"role": "user", "content": "x" * 12_000_000}])
    uploaded = client.files.create(file=("big.jsonl", _jsonl([line, _chat_line(1)])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = _wait(client, batch.id)
    assert done.status == "completed" and done.error_file_id is not None
    (error,) = _lines(client, done.error_file_id)
    alone = httpx.post(f"{client.base_url}chat/completions", json=line["body"], timeout=60)
    assert (error["response"]["status_code"], error["response"]["body"]["error"]["message"]) == (
        alone.status_code,
        alone.json()["error"]["message"],
    ), error
    assert alone.status_code != 413


def test_files_and_batches_belong_to_their_key(tmp_path: Path) -> None:
    with (
        serving("--state-dir", str(tmp_path), "--api-key", "alice", "--api-key", "bob") as (_, url),
        _client(url, "alice") as alice,
        _client(url, "bob") as bob,
    ):
        uploaded = alice.files.create(file=("in.jsonl", _jsonl([_chat_line(1)])), purpose="batch")
        with pytest.raises(openai.NotFoundError):
            bob.files.retrieve(uploaded.id)
        with pytest.raises(openai.NotFoundError):
            bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
        batch = alice.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert bob.batches.list().data == []
        with pytest.raises(openai.NotFoundError):
            bob.batches.retrieve(batch.id)
        assert _wait(alice, batch.id).status == "completed"
        # Tenth probe: as a list's cursor, Alice's id gave Bob his own files and batches
        # older than hers (so it told him hers existed, and when); now it is answered as an
        # unknown id is: a 400 naming after (twenty-third probe: both listed nothing, 200).
        mine = bob.files.create(file=("mine.jsonl", _jsonl([_chat_line(1)])), purpose="batch")
        bob.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
        later = alice.files.create(file=("later.jsonl", _jsonl([_chat_line(1)])), purpose="batch")
        later_batch = alice.batches.create(
            input_file_id=later.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        for listing, cursor in (
            (bob.files.list, later.id),
            (bob.files.list, "file-unknown"),
            (bob.batches.list, later_batch.id),
            (bob.batches.list, "batch_unknown"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                listing(after=cursor)
            assert refused.value.body["param"] == "after", cursor  # type: ignore[index]
            assert refused.value.body["message"].startswith(f"'after' is {cursor!r}, which is none of")  # type: ignore[index]
        assert [f.id for f in bob.files.list(after=mine.id)] == []  # his own: the page after it
        assert mine.id in [f.id for f in bob.files.list()]


def test_a_cancelled_batch_keeps_its_answers(shared: openai.OpenAI) -> None:
    lines = [_chat_line(i, max_tokens=64) for i in range(200)]
    client = shared
    uploaded = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < 2:  # type: ignore[union-attr]
        time.sleep(0.05)
    assert client.batches.cancel(batch.id).status == "cancelling"
    done = _wait(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    answered = _lines(client, done.output_file_id)
    never = _lines(client, done.error_file_id)
    assert 2 <= len(answered) < 200
    assert {line["error"]["code"] for line in never} == {"batch_cancelled"}
    assert sorted(line["custom_id"] for line in answered + never) == sorted(f"line-{i}" for i in range(200))
    with pytest.raises(openai.BadRequestError, match="cannot be cancelled"):
        client.batches.cancel(_completed(client))


def _completed(client: openai.OpenAI) -> str:
    uploaded = client.files.create(file=("in.jsonl", _jsonl([_chat_line(1)])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    return str(_wait(client, batch.id).id)


def _stopped_part_way(state_dir: Path, count: int, answered: int, stop: signal.Signals) -> tuple[str, str]:
    """A batch of ``count`` short lines on a server keeping its state in ``state_dir``,
    stopped with ``stop`` once ``answered`` lines are: the batch's id and the server's log."""
    lines = [_short_line(i) for i in range(count)]
    with serving("--state-dir", str(state_dir)) as (process, url), _client(url) as client:
        uploaded = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        while client.batches.retrieve(batch.id).request_counts.completed < answered:  # type: ignore[union-attr]
            time.sleep(0.02)
        process.send_signal(stop)
        process.wait(timeout=30)
        return batch.id, stopped_log(process)


@pytest.mark.parametrize(("stop", "count"), [(signal.SIGKILL, 2000), (signal.SIGTERM, 500)], ids=["sigkill", "sigterm"])
def test_a_batch_survives_a_restart_with_every_line_answered_once(
    tmp_path: Path, stop: signal.Signals, count: int
) -> None:
    batch_id, log = _stopped_part_way(tmp_path, count, count // 2, stop)
    assert " 500 " not in log  # the lines the stop cut short were cancelled (499), not failed
    with sqlite3.connect(tmp_path / "ortserve.db") as db:
        answered_before = db.execute("SELECT COUNT(*) FROM batch_lines WHERE status IS NOT NULL").fetchone()[0]
    assert count // 2 <= answered_before < count  # stopped halfway
    if stop == signal.SIGTERM:  # the lines it stopped itself are no suspects: they run as before, side by side
        with sqlite3.connect(tmp_path / "ortserve.db") as db:
            assert not db.execute("SELECT COUNT(*) FROM batch_lines WHERE status IS NULL AND started > 0").fetchone()[0]
    with serving("--state-dir", str(tmp_path)) as (_, url), _client(url) as client:
        done = _wait(client, batch_id, within=600)
        assert done.status == "completed"
        assert done.request_counts is not None and done.request_counts.completed == count
        answered = _lines(client, done.output_file_id)
        assert [line["custom_id"] for line in answered] == [f"line-{i}" for i in range(count)]
        assert len({line["id"] for line in answered}) == count
        assert all(line["response"]["status_code"] == 200 for line in answered)
        assert done.error_file_id is None


def test_a_line_the_server_ended_running_again_and_again_is_not_resumed(tmp_path: Path) -> None:
    """Sixteenth probe: a line that killed the server (a grammar past its compiler's stack)
    was resumed at every restart and killed it again. A line started three times (each
    start after the first: the server ended while it ran) is answered with an error."""
    count = 400
    batch_id, _ = _stopped_part_way(tmp_path, count, count // 4, signal.SIGKILL)
    with sqlite3.connect(tmp_path / "ortserve.db") as db:
        (poison,) = db.execute("SELECT MAX(line) FROM batch_lines WHERE status IS NULL").fetchone()
        db.execute("UPDATE batch_lines SET started = 3 WHERE batch_id = ? AND line = ?", (batch_id, poison))
    with serving("--state-dir", str(tmp_path)) as (process, url), _client(url) as client:
        done = _wait(client, batch_id, within=600)
        assert done.request_counts is not None and done.request_counts.completed == count - 1
        (refused,) = _lines(client, done.error_file_id)
        assert refused["custom_id"] == f"line-{poison - 1}" and refused["error"]["code"] == "line_not_resumed"
        log = stopped_log(process)
    assert "not run again, the server ended 3 times" in log


def _long_line(i: int, tokens: int) -> dict[str, Any]:
    """A completion line of exactly ``tokens`` new tokens (it runs a while)."""
    body = {"model": "tiny", "prompt": f"{i}", "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}
    return {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def _starts(state_dir: Path, batch_id: str) -> dict[int, int]:
    with sqlite3.connect(state_dir / "ortserve.db") as db:
        rows = db.execute("SELECT line, started FROM batch_lines WHERE batch_id = ?", (batch_id,)).fetchall()
    return dict(rows)


def _killed_as_it_starts(process: Any, state_dir: Path, batch_id: str, line: int, start: int) -> None:
    """SIGKILL the server as line ``line`` is started for the ``start``-th time, as a line
    that crashes the server would."""
    end = time.monotonic() + 120
    while _starts(state_dir, batch_id).get(line, 0) < start:
        assert time.monotonic() < end, f"line {line} was not started a {start}th time"
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def test_only_the_line_the_server_ends_on_is_not_resumed(tmp_path: Path) -> None:
    """Seventeenth probe: every line running when the server died was counted, so a line
    that killed it three times took the lines running beside it down too (7 of 30). A line
    started again runs alone: the server killed each time one line starts (three times),
    the lines that ran beside it the first time are answered, and only it is refused."""
    count, poison = 10, 3  # lines 1-8 start together (--batch-concurrency 8), 9 and 10 later
    lines = [_long_line(i, 900 if i + 1 == poison else 60) for i in range(count)]
    with serving("--state-dir", str(tmp_path)) as (process, url), _client(url) as client:
        uploaded = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        batch_id = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        ).id
        _killed_as_it_starts(process, tmp_path, batch_id, poison, 1)
    beside = {line for line, started in _starts(tmp_path, batch_id).items() if started == 1} - {poison}
    assert len(beside) == 7  # in flight with it, unanswered
    for start in (2, 3):
        with serving("--state-dir", str(tmp_path)) as (process, _):
            _killed_as_it_starts(process, tmp_path, batch_id, poison, start)
    with serving("--state-dir", str(tmp_path)) as (process, url), _client(url) as client:
        done = _wait(client, batch_id, within=300)
        assert done.request_counts is not None and done.request_counts.completed == count - 1
        answered = _lines(client, done.output_file_id)
        (refused,) = _lines(client, done.error_file_id)
    assert refused["custom_id"] == f"line-{poison - 1}" and refused["error"]["code"] == "line_not_resumed"
    assert sorted(line["custom_id"] for line in answered) == sorted(
        f"line-{i}" for i in range(count) if i != poison - 1
    )
    starts = _starts(tmp_path, batch_id)
    assert starts[poison] == 4  # three deaths, the last two alone; the fourth start refuses it
    assert all(starts[line] == 2 for line in beside)  # once beside it, then alone
    assert starts[9] == starts[10] == 1


def test_lines_a_shutdown_cuts_off_run_again_at_the_next_start(tmp_path: Path) -> None:
    """Twentieth probe, issue 45: a SIGTERM whose grace period ran out (a stream still going)
    cut the running lines off with 503 server_shutting_down, which were kept as their
    answers: the batch came back completed with those lines failed for good. Cut lines are
    unanswered, their starts given back, and the next start answers every line."""
    count = 8
    lines = [_long_line(i, 300) for i in range(count)]
    with serving("--state-dir", str(tmp_path), "--grace-period", "0.5") as (process, url), _client(url) as client:
        uploaded = client.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
        end = time.monotonic() + 60
        while not any(_starts(tmp_path, batch.id).values()):
            assert time.monotonic() < end, "no line started"
            time.sleep(0.01)
        # A stream past the grace period: its end is what cuts the work off.
        body = {"model": "tiny", "prompt": ["x"] * 16, "max_tokens": 480, "min_tokens": 480, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            stopped = False
            for line in response.iter_lines():
                if line and not stopped:
                    process.send_signal(signal.SIGTERM)
                    stopped = True
        assert process.wait(timeout=30) == 75
        stopped_log(process)
    with sqlite3.connect(tmp_path / "ortserve.db") as db:
        answered = db.execute("SELECT line, status FROM batch_lines WHERE status IS NOT NULL").fetchall()
        assert all(status == 200 for _, status in answered), answered  # none answered with the cut's 503
        assert not db.execute("SELECT COUNT(*) FROM batch_lines WHERE status IS NULL AND started > 0").fetchone()[0]
        (status,) = db.execute("SELECT status FROM batches WHERE id = ?", (batch.id,)).fetchone()
    assert status == "in_progress"
    with serving("--state-dir", str(tmp_path)) as (_, url), _client(url) as client:
        done = _wait(client, batch.id, within=600)
        assert done.status == "completed" and done.request_counts is not None
        assert done.request_counts.completed == count and done.error_file_id is None
