"""A transformers checkpoint (config.json + safetensors) served over HTTP: built by og's
builder in a child process at its first load, reported while it builds, and then the same
numbers as the folder the builder wrote from it by hand (``tiny-qwen2`` was built from
``tiny-qwen2-hf`` in fp32). Without the builder's dependencies (torch, transformers,
onnx-ir: the ``checkpoints`` extra, which CI does not install) the model fails alone,
naming the extra; each environment runs the test that applies to it."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from ortserve_runtime import ModelConfig
from ortserve_runtime.sources import SourceError, converted_folder
from ortserve_server import ServerConfig, create_app
from serving import TINY_MODEL, closing, running

CHECKPOINT = TINY_MODEL.with_name("tiny-qwen2-hf")
HAS_BUILDER = all(importlib.util.find_spec(name) is not None for name in ("torch", "transformers", "onnx_ir"))


@pytest.fixture
def url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("ORTSERVE_CACHE", str(tmp_path / "cache"))
    config = ServerConfig(
        models={"checkpoint": CHECKPOINT, "folder": TINY_MODEL},
        model_configs={"checkpoint": ModelConfig(quantize="fp32")},
        load_on_startup=False,
    )
    with running(create_app(config)) as base:
        yield base


def _completion(client: openai.OpenAI, model: str) -> list[tuple[str, float]]:
    reply = client.completions.create(
        model=model, prompt="hello world", max_tokens=6, temperature=0, logprobs=3, extra_body={"seed": 1}
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.token_logprobs
    return list(zip(logprobs.tokens, [float(x) for x in logprobs.token_logprobs if x is not None], strict=True))


@pytest.mark.skipif(not HAS_BUILDER, reason="og's builder needs the checkpoints extra (torch, transformers, onnx-ir)")
def test_a_checkpoint_is_built_reported_and_served_as_its_folder(url: str, tmp_path: Path) -> None:
    client = closing(openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300))
    expected = _completion(client, "folder")
    got: list[list[tuple[str, float]]] = []
    first = threading.Thread(target=lambda: got.append(_completion(client, "checkpoint")))
    first.start()  # the first request builds it (several seconds); meanwhile:
    statuses, health = [], []
    while first.is_alive():
        statuses.append(httpx.get(f"{url}/v1/models/checkpoint").json())
        started = time.monotonic()
        assert httpx.get(f"{url}/health").status_code == 200
        health.append(time.monotonic() - started)
        assert _completion(client, "folder") == expected  # another model keeps serving
        time.sleep(0.05)
    first.join()
    converting = [s["progress"] for s in statuses if s["status"] == "converting"]
    assert converting and converting == sorted(converting) and 0 <= converting[0] < converting[-1] <= 1
    # The builder runs in a child process: the loop stays free (what is left is the load of
    # 2 cores: see test_gguf_api's conversion test).
    assert max(health) < 1.5
    assert [t for t, _ in got[0]] == [t for t, _ in expected]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got[0], expected, strict=True)) < 1e-4
    assert httpx.get(f"{url}/v1/models/checkpoint").json()["status"] == "ready"
    (built,) = (p for p in (tmp_path / "cache" / "converted").glob("*-fp32-cpu-og*") if p.is_dir())
    assert (built / "genai_config.json").exists() and (built / "ortserve_source.json").exists()


@pytest.mark.skipif(HAS_BUILDER, reason="the builder's dependencies are installed here")
def test_without_the_builder_a_checkpoint_fails_alone_naming_the_extra(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "checkpoint", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "ortserve-runtime[checkpoints]" in message and "torch" in message
    card = httpx.get(f"{url}/v1/models/checkpoint").json()
    assert card["status"] == "error"
    folder = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "folder", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    )
    assert folder.status_code == 200


def test_quantize_is_refused_where_nothing_would_read_it() -> None:
    with pytest.raises(ValueError, match="quantize applies to transformers checkpoints"):
        create_app(ServerConfig(models={"folder": TINY_MODEL}, model_configs={"folder": ModelConfig(quantize="int8")}))
    with pytest.raises(ValueError, match="unknown quantize"):
        ModelConfig(quantize="int3")  # type: ignore[arg-type]
    cli = subprocess.run(
        [sys.executable, "-m", "ortserve_server", "serve", "--model", f"folder={TINY_MODEL}", "--quantize", "int8"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cli.returncode == 2 and "quantize (--quantize) applies to transformers checkpoints" in cli.stderr
    with pytest.raises(ValueError, match="no model served with the default config is one"):
        create_app(ServerConfig(models={"folder": TINY_MODEL}, model_config=ModelConfig(quantize="int8")))
    # A pair og's builder writes into a folder that does not run (fp16 on the CPU) is
    # refused before the checkpoint's files are read.
    with pytest.raises(SourceError, match="no fp16 folders for the cpu provider"):
        converted_folder(CHECKPOINT, precision="fp16", provider="cpu")


def test_an_onnx_export_beside_a_checkpoint_does_not_make_it_an_embedding_model(tmp_path: Path) -> None:
    """Many Hub repos of a causal LM carry transformers.js's ``onnx/model.onnx`` beside the
    safetensors: that is still a checkpoint to build, not an ONNX encoder to embed with."""
    from ortserve_runtime import detect_model_kind
    from ortserve_runtime.sources import source_kind

    folder = tmp_path / "repo"
    shutil.copytree(CHECKPOINT, folder)
    (folder / "onnx").mkdir()
    (folder / "onnx" / "model.onnx").write_bytes(b"a decoder exported for transformers.js")
    assert source_kind(folder) == "checkpoint" and detect_model_kind(folder) == "generative"
    assert source_kind(TINY_MODEL) is None  # a genai folder is served as it is
