"""``--prefix-cache-scope key``: callers with different API keys share no cached prompt rows,
so neither ``cached_tokens`` nor timing tells one what the other sent (the side channel
the prefix cache opens between users), through a real server and the official SDKs."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, closing, running

SECRET = [
    {"role": "system", "content": "The PIN is 4711. Never tell it. " * 6},
    {"role": "user", "content": "Hi"},
]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    # The default with several keys (auto); a fourteenth probe of issue 45 read Bob's system
    # prompt token by token from Alice's cached_tokens under the former default, shared.
    config = ServerConfig(models={"tiny": TINY_MODEL}, api_key=("key-alice", "key-bob"))
    with running(create_app(config)) as url:
        yield url


def _cached(url: str, key: str, salt: str | None = None) -> int:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0) as client:
        reply = client.chat.completions.create(
            model="tiny",
            messages=SECRET,  # type: ignore[arg-type]
            max_tokens=2,
            temperature=0,
            extra_body={} if salt is None else {"cache_salt": salt},
        )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def _warm(url: str, key: str, salt: str | None = None) -> int:
    """Cached tokens of a repeat of the prompt under ``key`` (its rows go into the cache
    while the engine is idle, so the repeat may need a moment)."""
    deadline = time.monotonic() + 10
    while (hit := _cached(url, key, salt)) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return hit


def test_each_key_reuses_only_its_own_prompts(url: str) -> None:
    assert _cached(url, "key-alice") == 0
    assert _warm(url, "key-alice") > 32
    # Bob sends Alice's exact prompt: no hit, so he learns nothing of what she sent.
    assert _cached(url, "key-bob") == 0
    assert _warm(url, "key-bob") > 32  # his own repeat hits his own rows
    # cache_salt still divides a key's callers further.
    assert _cached(url, "key-alice", salt="tab-2") == 0


def test_anthropic_and_completions_keep_the_scope(url: str) -> None:
    system = "The code word is heliotrope, do not say it. " * 8

    def cached(key: str) -> int:
        client = closing(anthropic.Anthropic(base_url=url, api_key=key, max_retries=0))
        message = client.messages.create(
            model="tiny", system=system, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        return message.usage.cache_read_input_tokens or 0

    assert cached("key-alice") == 0
    deadline = time.monotonic() + 10
    while (hit := cached("key-alice")) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hit > 32
    assert cached("key-bob") == 0

    prompt = "The PIN is 1234. Never tell it. " * 8

    def completion(key: str) -> int:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        reply = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    completion("key-bob")
    deadline = time.monotonic() + 10
    while completion("key-bob") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert completion("key-alice") == 0


def test_every_key_is_accepted_and_proven(url: str) -> None:
    for key in ("key-alice", "key-bob"):
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer key-carol"}).status_code == 401
    # LocalServer's attachment check: the server proves it holds each key, without naming any.
    proofs = httpx.get(f"{url}/health", headers={"x-ortserve-challenge": "n0nce"}).headers["x-ortserve-proof"]
    for key in ("key-alice", "key-bob"):
        assert hmac.new(key.encode(), b"n0nce", hashlib.sha256).hexdigest() in proofs.split(",")
    assert "key-alice" not in proofs


def test_key_scope_needs_keys() -> None:
    with pytest.raises(ValueError, match=r"prefix_cache_scope .key.*api_key"):
        create_app(ServerConfig(models={"tiny": TINY_MODEL}, prefix_cache_scope="key"))


def test_keys_share_cached_prompts_only_when_asked() -> None:
    """``shared`` lets several keys reuse each other's rows; one key alone shares with nobody,
    and ``auto`` leaves its cache as it was."""
    config = ServerConfig(models={"tiny": TINY_MODEL}, api_key=("key-alice", "key-bob"), prefix_cache_scope="shared")
    assert not config.keys_cached_apart
    assert not ServerConfig(api_key="one").keys_cached_apart
    assert ServerConfig(api_key={"a": "k1", "b": "k2"}).keys_cached_apart
    with running(create_app(config)) as shared:
        assert _cached(shared, "key-alice") == 0
        assert _warm(shared, "key-alice") > 32
        assert _warm(shared, "key-bob") > 32  # Alice's rows
