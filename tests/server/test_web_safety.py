"""A local server that web pages cannot drive (issue 14, items 3, 8 and 11), through a real
server on a loopback port: DNS rebinding (a foreign Host), cross-site requests (a foreign
Origin, "simple" content types), undecodable bodies, and what needs the API key."""

from __future__ import annotations

import gzip
import logging
from collections.abc import Iterator

import httpx
import openai
import pytest
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, running

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
EVIL = "https://evil.example"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}))) as base:
        yield base


def _refused(response: httpx.Response, status: int, words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]


def test_a_rebinding_host_is_refused(url: str) -> None:
    port = url.rsplit(":", 1)[1]
    for path in ("/v1/models", "/metrics", "/health", "/schema/openapi.json"):
        _refused(httpx.get(f"{url}{path}", headers={"Host": f"evil.example:{port}"}), 403, "evil.example")
    refused = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Host": "evil.example"})
    _refused(refused, 403, "--allow-host")
    for name in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "localhost"):
        assert httpx.get(f"{url}/v1/models", headers={"Host": name}).status_code == 200, name


def test_configured_hosts_and_host_check() -> None:
    config = ServerConfig(models={"tiny": TINY_MODEL}, allowed_hosts=("llm.internal",), load_on_startup=False)
    with running(create_app(config)) as url:
        assert httpx.get(f"{url}/v1/models", headers={"Host": "llm.internal:80"}).status_code == 200
        assert httpx.get(f"{url}/v1/models", headers={"Host": "evil.example"}).status_code == 403
    # A host app that checks Host itself (behind a proxy, say) turns ours off.
    unchecked = ServerConfig(models={"tiny": TINY_MODEL}, host_check=False, load_on_startup=False)
    with running(create_app(unchecked)) as url:
        assert httpx.get(f"{url}/v1/models", headers={"Host": "public.example"}).status_code == 200


def test_a_cross_site_page_is_refused(url: str) -> None:
    _refused(httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": EVIL}), 403, EVIL)
    form = {"model": "tiny"}
    files = {"file": ("a.wav", b"RIFF....WAVE", "audio/wav")}
    cross = httpx.post(f"{url}/v1/audio/transcriptions", data=form, files=files, headers={"Origin": EVIL})
    _refused(cross, 403, "--allow-origin")
    for origin in ("null", "chrome-extension://abc", "http://localhost.evil.example"):
        assert httpx.get(f"{url}/v1/models", headers={"Origin": origin}).status_code == 403, origin
    # Loopback pages (a local dev server) and the server's own pages may call it.
    for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "https://[::1]", url):
        ok = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": origin})
        assert ok.status_code == 200, origin
        assert "access-control-allow-origin" not in ok.headers  # CORS is off unless configured


def test_only_json_bodies_on_json_routes(url: str) -> None:
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        refused = httpx.post(f"{url}/v1/completions", content=body, headers={"Content-Type": content_type})
        _refused(refused, 415, repr(content_type))
        assert refused.json()["error"]["code"] == "unsupported_media_type"
    _refused(httpx.post(f"{url}/v1/completions", content=body), 415, "without Content-Type")
    form = httpx.post(f"{url}/v1/chat/completions", data={"model": "tiny"})
    _refused(form, 415, "application/x-www-form-urlencoded")
    json_to_multipart = httpx.post(f"{url}/v1/audio/transcriptions", json={"model": "tiny"})
    _refused(json_to_multipart, 415, "multipart/form-data")
    charset = httpx.post(
        f"{url}/v1/completions", content=body, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert charset.status_code == 200


def test_a_compressed_body_is_refused_by_its_coding(url: str) -> None:
    """Issue 45: no route undoes a Content-Encoding; a gzipped body was a 400 "JSON is
    malformed" and a plain one labelled gzip (or br) was served as if unlabelled."""
    body = b'{"model": "tiny", "prompt": "x", "max_tokens": 1}'
    json_type = {"Content-Type": "application/json"}
    for coding, content in (("gzip", gzip.compress(body)), ("gzip", body), ("br", body)):
        refused = httpx.post(
            f"{url}/v1/completions", content=content, headers={**json_type, "Content-Encoding": coding}
        )
        _refused(refused, 415, f"Content-Encoding {coding!r}")
    identity = httpx.post(f"{url}/v1/completions", content=body, headers={**json_type, "Content-Encoding": "identity"})
    assert identity.status_code == 200


def test_cors_when_configured() -> None:
    app_origin = "https://app.example"
    config = ServerConfig(models={"tiny": TINY_MODEL}, cors_origins=(app_origin,))
    with running(create_app(config)) as url:
        preflight = httpx.options(
            f"{url}/v1/chat/completions",
            headers={
                "Origin": app_origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, authorization",
            },
        )
        assert preflight.status_code in (200, 204)
        assert preflight.headers["access-control-allow-origin"] == app_origin
        ok = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": app_origin})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == app_origin
        assert httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Origin": EVIL}).status_code == 403


def test_undecodable_bodies_are_400_without_a_traceback(url: str, caplog: pytest.LogCaptureFixture) -> None:
    json_type = {"Content-Type": "application/json"}
    nested = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    files = {"file": ("a.wav", b"RIFF....WAVE", "audio/wav")}
    with caplog.at_level(logging.DEBUG):
        bad_utf8 = httpx.post(f"{url}/v1/chat/completions", content=b'{"model": "t\xffiny"}', headers=json_type)
        _refused(bad_utf8, 400, "UTF-8")
        too_deep = httpx.post(f"{url}/v1/chat/completions", content=nested, headers=json_type)
        _refused(too_deep, 400, "nested too deeply in 'messages'")
        assert too_deep.json()["error"]["param"] == "messages"  # the field, after those that nest less
        flat_first = b'{"n": [[1]], "stop": ' + b"[" * 100_000 + b"]" * 100_000 + b', "model": "tiny"}'
        too_deep = httpx.post(f"{url}/v1/chat/completions", content=flat_first, headers=json_type)
        assert too_deep.json()["error"]["param"] == "stop", too_deep.text
        form = httpx.post(f"{url}/v1/audio/transcriptions", data={"model": b"\xff\xfe"}, files=files)  # type: ignore[dict-item]
        _refused(form, 400, "UTF-8")
        _refused(httpx.post(f"{url}/v1/embeddings", content=b"[1, 2]", headers=json_type), 400, "JSON object")
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert httpx.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_an_empty_post_names_the_body(url: str) -> None:
    empty = httpx.post(f"{url}/v1/chat/completions", headers={"Content-Type": "application/json"})
    _refused(empty, 400, "no body")
    assert "'data'" not in empty.text


@pytest.fixture(scope="module")
def keyed() -> Iterator[str]:
    with running(create_app(ServerConfig(models={"tiny": TINY_MODEL}, api_key="s3cret"))) as base:
        yield base


def test_metrics_and_schema_need_the_key(keyed: str) -> None:
    for path in ("/metrics", "/schema", "/schema/openapi.json", "/v1/models"):
        refused = httpx.get(f"{keyed}{path}")
        _refused(refused, 401, "API key")
        assert refused.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{keyed}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(f"{keyed}/health").status_code == 200
    with (
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="nope", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()


def test_public_metrics_and_no_docs_pages() -> None:
    config = ServerConfig(models={"tiny": TINY_MODEL}, api_key="k", public_metrics=True, load_on_startup=False)
    with running(create_app(config)) as url:
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/schema/openapi.json").status_code == 401
        key = {"Authorization": "Bearer k"}
        schema = httpx.get(f"{url}/schema", headers=key)
        assert schema.status_code == 200 and "openapi" in schema.json()  # JSON, not a page with CDN scripts
        for page in ("/schema/swagger", "/schema/redoc", "/schema/elements", "/schema/rapidoc", "/schema/scalar"):
            assert httpx.get(f"{url}{page}", headers=key).status_code == 404, page
