"""The web page's routes over HTTP: the page and its headers, and the conversations it
keeps per API key (``/v1/ui/conversations``) in the state database, SQLite and PostgreSQL."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ortserve_server import ServerConfig, create_app
from ortserve_server import _conversation_store as store
from postgres import postgres_server
from serving import TINY_MODEL, rss_growth, running, watched

ALICE = {"Authorization": "Bearer alice-key"}
BOB = {"Authorization": "Bearer bob-key"}
JSON = {"content-type": "application/json"}
CONVERSATION = {
    "title": "Lists in Python",
    "model": "tiny",
    "system": "Be brief.",
    "settings": {"temperature": 0.5, "max_tokens": 64},
    "messages": [
        {"role": "user", "content": "How do I sort a list of Ärger and ærø?"},
        {
            "role": "assistant",
            "content": "Use sorted().",
            "reasoning": "simple",
            "stats": {"tokens": 3, "stopped": None},
        },
    ],
}


def keyed_config(state_dir: Path | None = None, **more: Any) -> ServerConfig:
    return ServerConfig(
        models={"tiny": TINY_MODEL}, api_key=("alice-key", "bob-key"), ui=True, state_dir=state_dir, **more
    )


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(create_app(keyed_config())) as base:
        yield base


@pytest.fixture
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30) as client:
        yield client


def test_the_page_is_served_with_its_headers_and_no_key(http: httpx.Client) -> None:
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self';" in csp and "unsafe" not in csp and "connect-src 'self'" in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    assert '<meta name="ortserve-keys" content="api">' in page.text
    assert '<script type="module" src="/assets/app.js">' in page.text
    script = http.get("/assets/app.js")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert http.get("/assets/vendor/purify.es.mjs").status_code == 200
    again = http.get("/assets/app.js", headers={"If-None-Match": script.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    for missing in ("/assets/nothing.js", "/assets/../_routes.py", "/assets/%2e%2e/_routes.py"):
        assert http.get(missing).status_code == 404, missing


def test_the_page_has_the_apis_host_and_origin_rules(http: httpx.Client) -> None:
    rebinding = http.get("/", headers={"Host": "evil.example"})
    assert rebinding.status_code == 403 and "Host" in rebinding.json()["error"]["message"]
    other_site = http.post("/v1/ui/conversations", json={}, headers={**ALICE, "Origin": "https://evil.example"})
    assert other_site.status_code == 403


def test_conversations_need_a_key_and_belong_to_it(http: httpx.Client) -> None:
    assert http.get("/v1/ui/conversations").status_code == 401
    made = http.post("/v1/ui/conversations", json=CONVERSATION, headers=ALICE)
    assert made.status_code == 200, made.text
    conversation = made.json()
    assert conversation["messages"] == CONVERSATION["messages"]
    assert conversation["settings"] == CONVERSATION["settings"]
    path = f"/v1/ui/conversations/{conversation['id']}"
    assert http.get(path, headers=ALICE).json() == conversation
    # Bob's key finds nothing of Alice's: not by id, not listed, not searched, not exported.
    for method in ("GET", "DELETE"):
        assert http.request(method, path, headers=BOB).status_code == 404
    assert http.post(path, json={"title": "mine now"}, headers=BOB).status_code == 404
    assert conversation["id"] not in str(http.get("/v1/ui/conversations", headers=BOB).json())
    assert conversation["id"] not in str(http.get("/v1/ui/conversations/export", headers=BOB).json())
    assert http.get(path, headers=ALICE).json()["title"] == "Lists in Python"


def test_rename_search_delete(http: httpx.Client) -> None:
    made = http.post("/v1/ui/conversations", json=CONVERSATION, headers=ALICE).json()
    path = f"/v1/ui/conversations/{made['id']}"
    renamed = http.post(path, json={"title": "Sorting 100%"}, headers=ALICE).json()
    assert renamed["title"] == "Sorting 100%" and renamed["messages"] == made["messages"]
    assert renamed["updated_at"] >= made["updated_at"]

    def found(search: str) -> list[str]:
        listed = http.get("/v1/ui/conversations", params={"search": search}, headers=ALICE)
        return [c["id"] for c in listed.json()["data"]]

    assert made["id"] in found("äRGER")  # case-insensitive beyond ASCII
    assert made["id"] in found("100%")
    assert made["id"] not in found("1%0")  # % and _ are text, not wildcards
    assert made["id"] not in found("role")  # the messages' text, not their JSON
    listed = http.get("/v1/ui/conversations", headers=ALICE).json()["data"]
    assert listed[0]["id"] == made["id"] and listed[0]["message_count"] == 2
    assert http.delete(path, headers=ALICE).json() == {"id": made["id"], "deleted": True, "object": "ui.conversation"}
    assert http.get(path, headers=ALICE).status_code == 404


def test_export_and_import_round_trip(http: httpx.Client) -> None:
    http.post("/v1/ui/conversations", json=CONVERSATION, headers=ALICE)
    exported = http.get("/v1/ui/conversations/export", headers=ALICE).json()
    assert exported["data"] and all("messages" in c for c in exported["data"])
    imported = http.post("/v1/ui/conversations/import", json=exported, headers=BOB)
    assert imported.status_code == 200, imported.text
    ids = [c["id"] for c in imported.json()["data"]]
    assert len(ids) == len(exported["data"]) and not set(ids) & {c["id"] for c in exported["data"]}
    again = http.get(f"/v1/ui/conversations/{ids[0]}", headers=BOB).json()
    original = exported["data"][0]
    assert again["messages"] == original["messages"] and again["created_at"] == original["created_at"]


def test_a_conversation_near_the_nesting_bound_imports_from_its_export(http: httpx.Client) -> None:
    """Twenty-fifth probe, issue 45: an export holds a conversation two levels deeper than it
    was sent, so one sent at the body's nesting bound (128) could not be imported back."""
    nested: Any = "x"
    for _ in range(123):  # the create body: itself, messages, the message, content, the part: 128
        nested = {"a": nested}
    part = {"type": "text", "text": "deep", "extra": nested}
    made = http.post("/v1/ui/conversations", json={"messages": [{"role": "user", "content": [part]}]}, headers=BOB)
    assert made.status_code == 200, made.text
    exported = http.get("/v1/ui/conversations/export", headers=BOB).json()
    mine = [c for c in exported["data"] if c["id"] == made.json()["id"]]
    imported = http.post("/v1/ui/conversations/import", json={"data": mine}, headers=BOB)
    assert imported.status_code == 200, imported.text
    mine[0]["messages"][0]["content"][0]["extra"] = {"a": nested}  # one level past what a create takes
    refused = http.post("/v1/ui/conversations/import", json={"data": mine}, headers=BOB)
    assert refused.status_code == 400 and "nested too deeply" in refused.text, refused.text


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"title": 3}, "title"),
        ({"title": "x" * 1001}, "title"),  # a list shows 1000 titles: a 15 MB one was taken
        ({"model": "m" * 1001}, "model"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"settings": {"temperature": "hot"}}, "temperature"),
        ({"settings": {"temprature": 0.2}}, "settings.temprature"),  # twenty-first probe: dropped
        ({"messages": [{"role": "user", "content": "a", "bogus": 1}]}, "bogus"),  # twenty-second: dropped
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(http: httpx.Client, body: dict[str, Any], field: str) -> None:
    answer = http.post("/v1/ui/conversations", json=body, headers=ALICE)
    assert answer.status_code == 400
    assert field in answer.json()["error"]["message"] or field == answer.json()["error"]["param"]


def test_bounds(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    assert http.get("/v1/ui/conversations", params={"limit": 0}, headers=ALICE).json()["error"]["param"] == "limit"
    assert http.get("/v1/ui/conversations", params={"search": "x" * 201}, headers=ALICE).status_code == 400
    monkeypatch.setattr(store, "MAX_CONVERSATION_BYTES", 1000)
    big = {"messages": [{"role": "user", "content": "x" * 2000}]}
    too_big = http.post("/v1/ui/conversations", json=big, headers=ALICE)
    assert too_big.status_code == 413 and "1000 bytes" in too_big.json()["error"]["message"]
    made = http.post("/v1/ui/conversations", json={"title": "small"}, headers=BOB).json()
    assert http.post(f"/v1/ui/conversations/{made['id']}", json=big, headers=BOB).status_code == 413
    assert http.get(f"/v1/ui/conversations/{made['id']}", headers=BOB).json()["messages"] == []
    kept = len(http.get("/v1/ui/conversations", headers=BOB).json()["data"])
    monkeypatch.setattr(store, "MAX_CONVERSATIONS", kept + 1)
    two = {"data": [{"title": "one"}, {"title": "two"}]}
    assert http.post("/v1/ui/conversations/import", json=two, headers=BOB).status_code == 413  # all or none
    assert len(http.get("/v1/ui/conversations", headers=BOB).json()["data"]) == kept
    assert http.post("/v1/ui/conversations", json={"title": "last"}, headers=BOB).status_code == 200
    full = http.post("/v1/ui/conversations", json={"title": "one more"}, headers=BOB)
    assert full.status_code == 413 and "at most" in full.json()["error"]["message"]


def test_a_key_keeps_a_bounded_number_of_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 45, seventh probe: 1000 conversations of 8 MiB a key, with their search text,
    were 16 GiB held in the server's memory (state_dir None: 60 of 7 MiB grew it 970 MiB)."""
    monkeypatch.setattr(store, "MAX_OWNER_BYTES", 300_000)
    turn = {"messages": [{"role": "user", "content": "x" * 100_000}]}
    with running(create_app(keyed_config())) as url, httpx.Client(base_url=url, timeout=30) as http:
        first, second = (http.post("/v1/ui/conversations", json=turn, headers=ALICE) for _ in range(2))
        assert first.status_code == second.status_code == 200
        full = http.post("/v1/ui/conversations", json=turn, headers=ALICE)
        assert full.status_code == 413, full.text[:200]
        assert "at most 300000 bytes of conversations" in full.json()["error"]["message"]
        both = {"data": [{"title": "a"}, turn]}  # all or none
        assert http.post("/v1/ui/conversations/import", json=both, headers=ALICE).status_code == 413
        assert len(http.get("/v1/ui/conversations", headers=ALICE).json()["data"]) == 2
        assert http.post("/v1/ui/conversations", json=turn, headers=BOB).status_code == 200  # each key its own
        # An update counts in place of the conversation it replaces.
        grown = {"messages": [{"role": "user", "content": "x" * 205_000}]}
        assert http.post(f"/v1/ui/conversations/{first.json()['id']}", json=grown, headers=ALICE).status_code == 413
        assert http.post(f"/v1/ui/conversations/{first.json()['id']}", json=turn, headers=ALICE).status_code == 200
        assert http.delete(f"/v1/ui/conversations/{second.json()['id']}", headers=ALICE).status_code == 200
        assert http.post("/v1/ui/conversations", json=turn, headers=ALICE).status_code == 200


@pytest.mark.timing  # /health's latency meanwhile (issue 45)
def test_an_import_past_the_bound_is_refused_before_its_work(http: httpx.Client, url: str) -> None:
    """45,000 conversations (under the JSON body's key bound) were each made and encoded on
    the event loop before the count was checked against the bound of 1000."""
    content = json.dumps({"data": [{"title": "t"}] * 45_000}).encode()
    with watched(url) as seen:
        refused = http.post("/v1/ui/conversations/import", content=content, headers={**BOB, **JSON})
    assert refused.status_code == 413 and "this import has 45000" in refused.json()["error"]["message"]
    seen.assert_within()


def test_an_export_is_written_a_conversation_at_a_time() -> None:
    """A key keeps up to 1000 conversations of 8 MiB: the export was made whole in memory
    (20 of 7 MiB grew the process by 573 MiB; 1000 would not fit). Written one at a time,
    it grows by a few conversations' worth."""
    with running(create_app(keyed_config())) as base, httpx.Client(base_url=base, timeout=60) as http:
        text = "y" * (7 * 2**20)
        content = json.dumps({"title": "big", "messages": [{"role": "user", "content": text}]}).encode()
        for _ in range(16):  # 112 MiB, under a key's 128 MiB
            assert http.post("/v1/ui/conversations", content=content, headers={**ALICE, **JSON}).status_code == 200
        http.post("/v1/ui/conversations", json=CONVERSATION, headers=ALICE)
        with rss_growth() as grown, http.stream("GET", "/v1/ui/conversations/export", headers=ALICE) as answer:
            size = sum(len(chunk) for chunk in answer.iter_raw())  # as a client reading it would
        assert answer.status_code == 200 and size > 16 * len(text)
        assert grown[0] < 100 * 2**20, f"+{grown[0] >> 20} MiB"
        exported = http.get("/v1/ui/conversations/export", headers=ALICE).json()
    assert exported["object"] == "list" and len(exported["data"]) == 17
    assert exported["data"][0]["title"] == CONVERSATION["title"]  # most recently updated first
    assert all(c["messages"][0]["content"] == text for c in exported["data"][1:])


def test_the_routes_are_in_the_openapi_schema(http: httpx.Client) -> None:
    paths = http.get("/schema/openapi.json", headers=ALICE).json()["paths"]
    assert {"get", "post"} <= set(paths["/v1/ui/conversations"])
    assert {"get", "post", "delete"} <= set(paths["/v1/ui/conversations/{conversation_id}"])
    assert "/v1/ui/conversations/export" in paths and "/v1/ui/conversations/import" in paths
    assert "/" not in paths and not any(p.startswith("/assets") for p in paths)


def test_conversations_survive_a_restart(tmp_path: Path) -> None:
    with running(create_app(keyed_config(tmp_path))) as base:
        made = httpx.post(f"{base}/v1/ui/conversations", json=CONVERSATION, headers=ALICE).json()
    with running(create_app(keyed_config(tmp_path))) as base:
        again = httpx.get(f"{base}/v1/ui/conversations/{made['id']}", headers=ALICE)
        assert again.status_code == 200 and again.json()["messages"] == CONVERSATION["messages"]
        assert httpx.get(f"{base}/v1/ui/conversations/{made['id']}", headers=BOB).status_code == 404


def test_conversations_in_postgresql() -> None:
    with postgres_server() as state_url:
        config = ServerConfig(
            models={"tiny": TINY_MODEL}, api_key=("alice-key", "bob-key"), ui=True, state_url=state_url
        )
        config.load_on_startup = False
        with running(create_app(config)) as base, httpx.Client(base_url=base, timeout=30) as http:
            made = http.post("/v1/ui/conversations", json=CONVERSATION, headers=ALICE).json()
            got = http.get(f"/v1/ui/conversations/{made['id']}", headers=ALICE).json()
            assert got["messages"] == CONVERSATION["messages"]
            found = http.get("/v1/ui/conversations", params={"search": "ÄRGER"}, headers=ALICE).json()["data"]
            assert [c["id"] for c in found] == [made["id"]]
            assert http.get("/v1/ui/conversations", params={"search": "1%0"}, headers=ALICE).json()["data"] == []
            assert http.get(f"/v1/ui/conversations/{made['id']}", headers=BOB).status_code == 404


def test_a_mounted_server_serves_the_page_only_when_asked() -> None:
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, load_on_startup=False))) as base:
        assert httpx.get(f"{base}/").status_code == 404
        assert httpx.get(f"{base}/v1/ui/conversations").status_code == 404
    config = ServerConfig(models={"tiny": TINY_MODEL}, load_on_startup=False, ui=True, ui_path="/playground")
    with running(create_app(config)) as base:
        page = httpx.get(f"{base}/playground")
        assert page.status_code == 200 and 'src="/playground/assets/app.js"' in page.text
        assert httpx.get(f"{base}/playground/assets/app.js").status_code == 200
        assert httpx.get(f"{base}/").status_code == 404


def test_under_a_starlette_mount_the_page_names_the_prefixed_paths() -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount

    inner = create_app(ServerConfig(models={"tiny": TINY_MODEL}, ui=True, load_on_startup=False))
    with running(Starlette(routes=[Mount("/llm", app=inner)])) as base:
        page = httpx.get(f"{base}/llm/").text
        assert '<meta name="ortserve-api" content="/llm/v1">' in page
        assert '<script type="module" src="/llm/assets/app.js">' in page
        assert httpx.get(f"{base}/llm/assets/app.js").status_code == 200


@pytest.mark.timing  # how long another key waits meanwhile (issue 45)
def test_a_search_does_not_hold_other_keys_state() -> None:
    """Sixteenth probe: a query that nearly matched a key's conversations (SQL LIKE, a naive
    scan) took 42 s over 70 MiB, and every other key's stored data waited for the database
    the whole time. Python's search reads a conversation a call."""
    with running(create_app(keyed_config())) as base, httpx.Client(base_url=base, timeout=120) as http:
        content = json.dumps({"title": "big", "messages": [{"role": "user", "content": "a" * (7 * 2**20)}]}).encode()
        for _ in range(2):
            assert http.post("/v1/ui/conversations", content=content, headers={**ALICE, **JSON}).status_code == 200
        mine = http.post("/v1/ui/conversations", json=CONVERSATION, headers=BOB).json()["id"]
        done = threading.Event()
        waits: list[float] = []

        def bob_reads() -> None:
            while not done.is_set():
                started = time.monotonic()
                assert http.get(f"/v1/ui/conversations/{mine}", headers=BOB).status_code == 200
                waits.append(time.monotonic() - started)
                time.sleep(0.05)

        reader = threading.Thread(target=bob_reads)
        reader.start()
        try:
            started = time.monotonic()
            found = http.get("/v1/ui/conversations", params={"search": "a" * 199 + "b"}, headers=ALICE)
            took = time.monotonic() - started
        finally:
            done.set()
            reader.join()
        assert found.status_code == 200 and found.json()["data"] == []
        assert took < 5, took
        assert waits and max(waits) < 1, max(waits)
        hit = http.get("/v1/ui/conversations", params={"search": "A" * 200}, headers=ALICE).json()["data"]
        assert len(hit) == 2
