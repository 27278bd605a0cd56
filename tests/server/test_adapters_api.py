"""LoRA adapters per request through a real server with the official openai SDK: the model
id ``MODEL:ADAPTER`` picks an adapter (as vLLM and llama-server list theirs), on the ort-cpu
and og-generator engines, with greedy output equal to onnxruntime-genai's own."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import numpy as np
import onnxruntime as ort
import openai
import pytest
from og_reference import og_greedy, ordinary_ids
from ortserve_runtime import ModelConfig
from ortserve_server import ServerConfig, create_app
from serving import LORA_ADAPTERS, LORA_MODEL, TINY_MODEL, closing, running
from tokenizers import Tokenizer

PROMPT = ordinary_ids(40, seed=1)
TOKENIZER = Tokenizer.from_file(str(LORA_MODEL / "tokenizer.json"))
REFERENCE = {
    adapter: TOKENIZER.decode(og_greedy(PROMPT, 12, LORA_MODEL, adapter=LORA_ADAPTERS.get(adapter or "")))
    for adapter in (None, "alpha", "beta")
}
"""Greedy text of ``PROMPT`` through each adapter (``None``: the base), by og.Generator."""


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    lora = ModelConfig(adapters=dict(LORA_ADAPTERS))
    config = ServerConfig(
        models={"lora": LORA_MODEL, "lora-og": LORA_MODEL, "tiny": TINY_MODEL},
        model_configs={"lora": lora, "lora-og": ModelConfig(engine="og-generator", adapters=dict(LORA_ADAPTERS))},
    )
    with running(create_app(config)) as base:
        yield base


def model_id(model: str, adapter: str | None) -> str:
    return model if adapter is None else f"{model}:{adapter}"


@pytest.mark.parametrize("model", ["lora", "lora-og"])
def test_each_adapter_answers_as_og_does(client: openai.OpenAI, model: str) -> None:
    assert len(set(REFERENCE.values())) == 3  # each adapter changes the output
    for adapter, text in REFERENCE.items():
        result = client.completions.create(model=model_id(model, adapter), prompt=PROMPT, max_tokens=12, temperature=0)
        assert result.model == model_id(model, adapter)
        assert result.choices[0].text == text, adapter


@pytest.mark.parametrize("model", ["lora", "lora-og"])
def test_chat_streams_through_an_adapter(client: openai.OpenAI, url: str, model: str) -> None:
    messages = [{"role": "user", "content": "Write a poem about the sea"}]
    ids = httpx.post(f"{url}/v1/tokenize", json={"model": f"{model}:beta", "messages": messages}).json()["tokens"]
    reference = TOKENIZER.decode(og_greedy(ids, 10, LORA_MODEL, adapter=LORA_ADAPTERS["beta"]))
    stream = client.chat.completions.create(
        model=f"{model}:beta",
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,  # type: ignore[list-item]
    )
    chunks = list(stream)
    assert {c.model for c in chunks} == {f"{model}:beta"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference


def test_every_api_family_takes_the_adapter_model_id(client: openai.OpenAI, url: str) -> None:
    """Chat Completions, Responses and Anthropic Messages: the same greedy answer through beta."""
    chat = client.chat.completions.create(
        model="lora:beta", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    base = client.chat.completions.create(
        model="lora", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content != base.choices[0].message.content
    response = client.responses.create(model="lora:beta", input="Hi", max_output_tokens=8, temperature=0)
    assert (response.model, response.output_text) == ("lora:beta", chat.choices[0].message.content)
    with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as messages_client:
        message = messages_client.messages.create(  # the SDK no longer types temperature
            model="lora:beta", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, extra_body={"temperature": 0}
        )
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]


def test_two_adapters_in_concurrent_requests(url: str) -> None:
    """Both adapters and the base at once on both engines: each request gets its own
    adapter's output (ort-cpu decodes each adapter's rows in its own call)."""
    order = [(model, adapter) for _ in range(3) for model in ("lora", "lora-og") for adapter in ("alpha", "beta", None)]

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
            calls = [
                client.completions.create(model=model_id(m, a), prompt=PROMPT, max_tokens=12, temperature=0)
                for m, a in order
            ]
            return [r.choices[0].text for r in await asyncio.gather(*calls)]

    assert asyncio.run(main()) == [REFERENCE[adapter] for _, adapter in order]


def test_models_lists_adapters_with_their_parent(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list()}
    assert list(cards) == ["lora", "lora:alpha", "lora:beta", "lora-og", "lora-og:alpha", "lora-og:beta", "tiny"]
    alpha = cards["lora:alpha"]
    assert (alpha.parent, alpha.root, alpha.kind, alpha.engine) == ("lora", "lora", "generative", "ort-cpu")  # type: ignore[attr-defined]
    assert cards["lora"].parent is None  # type: ignore[attr-defined]
    assert client.models.retrieve("lora-og:beta").parent == "lora-og"  # type: ignore[attr-defined]


def test_an_unknown_adapter_is_a_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="lora:gamma", prompt="hello", max_tokens=2)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["message"] == "model 'lora' has no LoRA adapter 'gamma': its adapters are 'alpha', 'beta'"
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'gamma'"):
        client.chat.completions.create(model="lora-og:gamma", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'gamma'"):
        client.models.retrieve("lora:gamma")
    assert (
        client.completions.create(model="lora", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
        == (REFERENCE[None])
    )  # and the server keeps serving


def test_an_adapter_of_a_model_without_adapters_says_so(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="tiny:alpha", prompt="hello", max_tokens=2)
    assert caught.value.body["message"] == (  # type: ignore[index]
        "model 'tiny' has no LoRA adapter 'alpha': it has none (serve one with --adapter tiny:alpha=PATH)"
    )
    with pytest.raises(openai.NotFoundError, match="model 'nope:alpha' does not exist"):
        client.completions.create(model="nope:alpha", prompt="hello", max_tokens=2)


def test_llama_servers_lora_field_is_refused_pointing_at_the_model_id(client: openai.OpenAI) -> None:
    """Per-request adapter scales cannot be honoured (onnxruntime adapters carry their
    scale); a request with them gets a 400 rather than the base model in silence."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="lora", prompt="hello", max_tokens=2, extra_body={"lora": [{"id": 0, "scale": 0.5}]}
        )
    assert caught.value.body["param"] == "lora"  # type: ignore[index]
    assert "model id MODEL:ADAPTER" in caught.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError, match="'lora' is not supported"):
        client.chat.completions.create(
            model="lora-og", messages=[{"role": "user", "content": "hi"}], extra_body={"lora": []}
        )


def test_adapters_load_and_unload_over_http_as_in_vllm(tmp_path: Path) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter behind the admin key, with the
    openai SDK using what they serve; off unless the server allows them."""
    config = ServerConfig(
        models={"lora": LORA_MODEL, "tiny": TINY_MODEL}, runtime_adapters=True, admin_key="admin", api_key="user"
    )
    admin = {"Authorization": "Bearer admin"}
    big = tmp_path / "big.onnx_adapter"  # larger than the model: refused before it is read
    with big.open("wb") as sparse:
        sparse.truncate(2**31)
    with running(create_app(config)) as base:
        client = closing(openai.OpenAI(base_url=f"{base}/v1", api_key="user", max_retries=0))
        body = {"lora_name": "lora:alpha", "lora_path": str(LORA_ADAPTERS["alpha"])}
        user = httpx.post(f"{base}/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer user"})
        assert user.status_code == 403, user.text  # the API key is not enough (and is told so)
        loaded = httpx.post(f"{base}/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
        assert loaded.status_code == 200, loaded.text
        assert (loaded.json()["id"], loaded.json()["parent"]) == ("lora:alpha", "lora")
        assert "lora:alpha" in [m.id for m in client.models.list()]
        result = client.completions.create(model="lora:alpha", prompt=PROMPT, max_tokens=12, temperature=0)
        assert result.choices[0].text == REFERENCE["alpha"]

        refusals = [
            ({**body}, 400, "lora_name", "already has a LoRA adapter 'alpha'"),
            ({"lora_name": "beta", "lora_path": str(LORA_ADAPTERS["beta"])}, 400, "model", "name the model"),
            # One answer whatever is wrong with the file: the route does not tell which files
            # exist or can be read (the log says why).
            ({"lora_name": "tiny:beta", "lora_path": str(LORA_ADAPTERS["beta"])}, 400, "lora_path", "not a usable"),
            ({"lora_name": "lora:beta", "lora_path": "/nonexistent.onnx_adapter"}, 400, "lora_path", "not a usable"),
            ({"lora_name": "lora:beta", "lora_path": "/etc/shadow"}, 400, "lora_path", "not a usable"),
            ({"lora_name": "lora:beta", "lora_path": str(big)}, 400, "lora_path", "not a usable"),
            *(
                ({"lora_name": f"lora:{bad}", "lora_path": str(LORA_ADAPTERS["beta"])}, 400, "lora_name", "1 to 64")
                for bad in ("../../x", "a/b", "a\x00b", "x" * 5000, ".hidden", "")
            ),
            ({"lora_name": "beta", "model": "nope", "lora_path": str(LORA_ADAPTERS["beta"])}, 404, "model", "nope"),
            ({"lora_name": "lora:beta"}, 400, "lora_path", "lora_path"),
        ]
        for request, status, param, words in refusals:
            response = httpx.post(f"{base}/v1/load_lora_adapter", json=request, headers=admin, timeout=60)
            assert response.status_code == status, (request, response.text)
            error = response.json()["error"]
            assert error["param"] == param and words in error["message"], (request, error)

        unloaded = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "lora:alpha"}, headers=admin)
        assert unloaded.json() == {"id": "lora:alpha", "object": "model", "deleted": True}
        with pytest.raises(openai.NotFoundError, match="no LoRA adapter 'alpha'"):
            client.completions.create(model="lora:alpha", prompt=PROMPT, max_tokens=2)
        again = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "lora:alpha"}, headers=admin)
        assert again.status_code == 404 and "no LoRA adapter 'alpha'" in again.json()["error"]["message"]
        assert (
            client.completions.create(model="lora", prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
            == (REFERENCE[None])
        )  # the server keeps serving

    with running(create_app(ServerConfig(models={"lora": LORA_MODEL}))) as base:
        off = httpx.post(f"{base}/v1/load_lora_adapter", json=body)
        assert off.status_code == 403 and "--allow-runtime-adapters" in off.json()["error"]["message"]


def _adapter_like(path: Path, change: Callable[[dict[str, np.ndarray]], None]) -> Path:
    """The alpha adapter with ``change`` made to its tensors, written to ``path``."""
    tensors = {
        name: value.numpy()
        for name, value in ort.AdapterFormat.read_adapter(str(LORA_ADAPTERS["alpha"])).get_parameters().items()
    }
    change(tensors)
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    adapter.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in tensors.items()})
    adapter.export_adapter(str(path))
    return path


def test_an_adapter_the_decoder_cannot_take_is_refused_when_loaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Eighth probe of issue 45: an adapter whose tensors had the decoder's input names but
    another shape, element type, LoRA rank, or NaN values loaded (200) and then every
    request that picked it was a bare 500 "the model failed to process the request"."""
    first = "model.layers.0.attn.k_proj.lora_A.MatMul.weight"
    changes: dict[str, Callable[[dict[str, np.ndarray]], None]] = {
        "shape": lambda t: t.update({first: np.zeros((3, 5), np.float32)}),
        "dtype": lambda t: t.update({first: t[first].astype(np.float16)}),
        "rank": lambda t: t.update({first: np.zeros((t[first].shape[0], 6), np.float32)}),
        "nan": lambda t: t.update({first: np.full_like(t[first], np.nan)}),
    }
    said = {"shape": "of shape [3, 5]", "dtype": "is float16", "rank": "has lora_rank = 6", "nan": "not finite"}
    config = ServerConfig(models={"lora": LORA_MODEL}, runtime_adapters=True, admin_key="admin")
    with running(create_app(config)) as base:
        for name, change in changes.items():
            path = _adapter_like(tmp_path / f"{name}.onnx_adapter", change)
            body = {"lora_name": f"lora:{name}", "lora_path": str(path)}
            with caplog.at_level(logging.WARNING, logger="ortserve.server"):
                response = httpx.post(
                    f"{base}/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer admin"}, timeout=60
                )
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["param"] == "lora_path"
            assert said[name] in caplog.text, (name, caplog.text)
            chat = {"model": f"lora:{name}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert httpx.post(f"{base}/v1/chat/completions", json=chat).status_code == 404
