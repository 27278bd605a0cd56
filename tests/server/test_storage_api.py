"""What the server stores (uploaded files, stored responses) under hostile or unlucky
conditions, through a real server: listing limits out of range, a batch line nested
5,000 deep, and a full state database are 4xx/507 answers naming the cause, never a 500,
and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running, watched


@pytest.fixture(scope="module")
def app_url() -> Iterator[tuple[Any, str]]:
    app = create_app(ServerConfig(models={"tiny": TINY_MODEL}))
    with running(app) as base:
        yield app, base


@pytest.fixture
def client(app_url: tuple[Any, str]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{app_url[1]}/v1", api_key="x", max_retries=0) as c:
        yield c


def _line(body: str, custom_id: str = "a") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"})[:-1].encode() + (
        b', "body": ' + body.encode() + b"}\n"
    )


CHAT = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
MANY = b"".join(_line(CHAT, f"line-{i}") for i in range(200))  # 30 KB: more than a page
METADATA = {f"k{i}": "v" * 512 for i in range(16)}


@pytest.mark.parametrize("limit", [0, -1, 10_001])
@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_a_files_limit_out_of_range_is_a_400(client: openai.OpenAI, app_url: tuple[Any, str], limit: int) -> None:
    client.files.create(file=("in.jsonl", _line(CHAT)), purpose="batch")  # with a file, limit 0 was a 500
    with watched(app_url[1]) as seen:
        listed = httpx.get(f"{app_url[1]}/v1/files", params={"limit": limit})
    seen.assert_within()
    assert listed.status_code == 400, listed.text
    error = listed.json()["error"]
    assert error["param"] == "limit" and "between 1 and 10000" in error["message"]
    assert len(client.files.list(limit=1).data) == 1


def test_files_list_in_either_order_a_page_at_a_time(client: openai.OpenAI, app_url: tuple[Any, str]) -> None:
    """Eighth probe of issue 45: `order` was ignored (newest first always), as OpenAI's
    list takes it; a value other than asc or desc is a 400 naming it."""
    made = [client.files.create(file=(f"{i}.jsonl", _line(CHAT)), purpose="batch").id for i in range(3)]
    oldest_first = [f.id for f in client.files.list(order="asc") if f.id in made]  # the SDK follows `after`
    newest_first = [f.id for f in client.files.list(order="desc") if f.id in made]
    assert oldest_first == made and newest_first == made[::-1]
    page = client.files.list(order="asc", limit=1, after=made[0])
    assert [f.id for f in page.data] == [made[1]]
    refused = httpx.get(f"{app_url[1]}/v1/files", params={"order": "up"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "order"
    # Twenty-third probe: a purpose no file can have listed nothing, 200; one OpenAI's can is taken.
    refused = httpx.get(f"{app_url[1]}/v1/files", params={"purpose": "bogus"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "purpose", refused.text
    assert client.files.list(purpose="fine-tune").data == []
    assert made[0] in [f.id for f in client.files.list(purpose="batch")]


def test_files_deleted_while_they_are_paged_through_leave_the_paging_going(client: openai.OpenAI) -> None:
    """Twenty-fifth probe, issue 45: the SDK's ``for f in client.files.list(limit=2):
    client.files.delete(f.id)`` asks for the page after the file it just deleted, which was
    a 400 once a cursor that is none of the key's files was (twenty-third probe)."""
    made = {client.files.create(file=(f"{i}.jsonl", _line(CHAT)), purpose="batch").id for i in range(7)}
    seen = []
    for listed in client.files.list(limit=2):
        seen.append(listed.id)
        if listed.id in made:
            client.files.delete(listed.id)
    assert made <= set(seen) and len(seen) == len(set(seen))  # every one once
    assert not made & {f.id for f in client.files.list()}
    with pytest.raises(openai.BadRequestError):  # an id no file of the key ever had is still refused
        client.files.list(after="file-never")


def test_a_form_past_the_multipart_bounds_says_which(app_url: tuple[Any, str]) -> None:
    """Fifth probe of issue 45: 100,000 parts, or a 1 MB file name, were a 400 saying only
    "Request Entity Too Large" (Litestar's multipart parser)."""
    parts = "".join(f'--bb\r\nContent-Disposition: form-data; name="p{i}"\r\n\r\nv\r\n' for i in range(1001))
    form = {"content-type": "multipart/form-data; boundary=bb"}
    refused = httpx.post(f"{app_url[1]}/v1/files", content=parts + "--bb--\r\n", headers=form)
    assert refused.status_code == 400, refused.text
    assert "at most 1000 parts" in refused.json()["error"]["message"]


def test_a_file_upload_with_a_field_this_server_does_not_take_is_refused(client: openai.OpenAI) -> None:
    """Sixteenth probe: OpenAI's expires_after (or any other field) was taken and ignored."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(
            file=("in.jsonl", _line(CHAT)), purpose="batch", expires_after={"anchor": "created_at", "seconds": 3600}
        )
    assert refused.value.body["param"] == "expires_after"  # type: ignore[index]


def test_a_batch_line_with_a_field_its_route_does_not_take_is_refused(client: openai.OpenAI) -> None:
    """Sixth probe of issue 45: the field sent alone is a 400, in a batch line it was
    accepted and ignored (an embeddings line with an unknown key was answered 200)."""
    embeddings = json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings"})[:-1].encode()
    for line in (
        _line(CHAT.replace('"max_tokens"', '"guided_jsonn": {}, "max_tokens"'), "b"),
        embeddings + b', "body": {"model": "m", "input": "x", "dimension": 8}}\n',
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.files.create(file=("in.jsonl", _line(CHAT) + line), purpose="batch")
        assert caught.value.body["param"] == "file"  # type: ignore[index]
        message = caught.value.message
        assert "line 2: body: unknown field" in message and "--lenient" in message, message
        assert ("'guided_jsonn'" in message) != ("'dimension'" in message), message


def test_a_batch_line_nested_past_the_bound_or_with_an_unknown_key_is_refused(client: openai.OpenAI) -> None:
    """Twenty-first probe, issue 45: a line nested 971 deep (which JSON still decodes) failed
    as a 500 when it ran, and a key beside custom_id, method, url and body was ignored."""
    deep = CHAT.replace('"max_tokens"', '"guided_json": ' + '{"a": ' * 200 + "1" + "}" * 200 + ', "max_tokens"')
    bogus = json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "bogus": 1})[:-1].encode()
    for line, said in (
        (_line(deep, "b"), "nested too deeply (201 levels; at most 128)"),
        (bogus + b', "body": ' + CHAT.encode() + b"}\n", "unknown field `bogus`"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.files.create(file=("in.jsonl", _line(CHAT) + line), purpose="batch")
        assert caught.value.body["param"] == "file"  # type: ignore[index]
        assert "line 2: " in caught.value.message and said in caught.value.message, caught.value.message


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_a_batch_line_nested_too_deeply_is_refused_by_number(client: openai.OpenAI, app_url: tuple[Any, str]) -> None:
    deep = '{"model": "tiny", "messages": [], "x": ' + '{"a": ' * 5000 + "1" + "}" * 5000 + "}"
    for body in (deep, CHAT.replace('"max_tokens"', '"user": ' + "[" * 5000 + "]" * 5000 + ', "max_tokens"')):
        with pytest.raises(openai.BadRequestError) as caught, watched(app_url[1]) as seen:
            client.files.create(file=("in.jsonl", _line(CHAT) + _line(body, "b")), purpose="batch")
        seen.assert_within()
        assert "line 2: " in caught.value.message and "nested too deeply" in caught.value.message
        assert caught.value.body["param"] == "file"  # type: ignore[index]


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_a_batch_line_past_a_bodys_key_bounds_is_refused_before_decoding(
    client: openai.OpenAI, app_url: tuple[Any, str]
) -> None:
    """Twenty-fifth probe, issue 45: a batch file's lines were held to a body's size and
    nesting only: lines of 620,000 tools were decoded at upload and again at the run (+572-629
    MiB, /health 668-926 ms), where the same body sent alone is refused before decoding."""
    tools = '[{"type": "function", "function": {"name": ""}}]'[1:-1]
    many = CHAT.replace('"max_tokens"', '"tools": [' + ", ".join([tools] * 30_000) + '], "max_tokens"')
    with pytest.raises(openai.BadRequestError) as caught, watched(app_url[1]) as seen:
        client.files.create(file=("in.jsonl", _line(CHAT) + _line(many, "b")), purpose="batch")
    seen.assert_within()
    assert caught.value.body["param"] == "file"  # type: ignore[index]
    assert "line 2: the JSON has 90010 object keys (at most 50000)" in caught.value.message
    assert "most of them in 'body'" in caught.value.message, caught.value.message


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_a_full_state_database_is_a_507_and_nothing_is_lost(client: openai.OpenAI, app_url: tuple[Any, str]) -> None:
    """SQLite's own SQLITE_FULL ("database or disk is full"), made real by capping the file's
    pages at what it holds (PRAGMA max_page_count): what a full disk gives."""
    app, base = app_url
    database = app.state.ortserve.database
    kept = client.responses.create(model="tiny", input="kept", max_output_tokens=1, store=True)

    def cap(pages: str) -> None:
        database.submit(lambda db: db.execute(f"PRAGMA max_page_count = {pages}")).result()

    pages = database.submit(lambda db: db.execute("PRAGMA page_count").fetchone()[0]).result()
    cap(str(pages))
    try:
        with pytest.raises(openai.APIStatusError) as upload, watched(base) as seen:
            client.files.create(file=("in.jsonl", MANY), purpose="batch")
        with pytest.raises(openai.APIStatusError) as stored:
            client.responses.create(model="tiny", input="hi", max_output_tokens=1, store=True, metadata=METADATA)
        seen.assert_within()
        for caught in (upload, stored):
            assert caught.value.status_code == 507
            assert isinstance(caught.value.body, dict) and caught.value.body["code"] == "insufficient_storage"
            assert "storage is full" in caught.value.message
        streamed = client.responses.create(
            model="tiny", input="hi", max_output_tokens=1, store=True, metadata=METADATA, stream=True
        )
        last = list(streamed)[-1]  # not response.completed: the response it names was not stored
        assert last.type == "error" and last.code == "insufficient_storage", last  # type: ignore[union-attr]
        assert client.responses.create(model="tiny", input="hi", max_output_tokens=1).output  # still serving
        assert client.responses.retrieve(kept.id).id == kept.id  # nothing lost
    finally:
        cap("1073741823")
    assert client.files.create(file=("in.jsonl", MANY), purpose="batch").bytes == len(MANY)
    client.responses.create(model="tiny", input="hi", max_output_tokens=1, store=True, metadata=METADATA)
    assert json.loads(httpx.get(f"{base}/health").text)
