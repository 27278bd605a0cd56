"""The model registry: recognising folders, typed errors naming the path, load/unload."""

from __future__ import annotations

import asyncio
import gc
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
from audio import TINY_WHISPER
from fuzzing import CROSS_ENCODER
from images import TINY_PHI3V
from ortserve_runtime import (
    EngineClosedError,
    ModelCapacityError,
    ModelConfig,
    ModelLoadError,
    ModelNotFoundError,
    ModelRegistry,
    detect_model_kind,
)
from serving import TINY_MODEL

pytestmark = pytest.mark.anyio


def test_detects_a_genai_folder() -> None:
    assert detect_model_kind(TINY_MODEL) == "generative"


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        ModelRegistry().add("x", tmp_path / "nowhere")
    assert info.value.path == tmp_path / "nowhere"
    assert str(tmp_path / "nowhere") in str(info.value)


def test_folder_that_is_not_a_model(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="not a model folder") as info:
        ModelRegistry().add("x", tmp_path)
    assert info.value.path == tmp_path
    with pytest.raises(ModelLoadError, match="neither a model folder nor a GGUF file"):
        ModelRegistry().add("x", tmp_path / "notes.txt")


@pytest.mark.parametrize(
    ("damage", "culprit"),
    [
        (lambda d: (d / "model.onnx").write_bytes(b"garbage, not a protobuf"), "model.onnx"),
        (lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes()[:7000]), "model.onnx"),
        (lambda d: (d / "model.onnx.data").write_bytes((d / "model.onnx.data").read_bytes()[:300_000]), "model.onnx"),
        (lambda d: (d / "model.onnx.data").unlink(), "model.onnx"),
        (lambda d: (d / "model.onnx").unlink(), "model.onnx"),
        (lambda d: (d / "genai_config.json").write_text("{not json"), "genai_config.json"),
        (lambda d: (d / "genai_config.json").write_text('{"model": {}}'), "genai_config.json"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json"),
        (lambda d: (d / "tokenizer.json").write_text("[]"), "tokenizer.json"),
    ],
)
async def test_corrupt_model_names_the_path(tmp_path: Path, damage: object, culprit: str) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(TINY_MODEL, folder)
    damage(folder)  # type: ignore[operator]
    registry = ModelRegistry()
    registry.add("broken", folder)
    with pytest.raises(ModelLoadError) as info:
        await registry.get("broken")
    assert str(folder) in str(info.value)
    assert culprit in str(info.value)
    assert info.value.path.is_relative_to(folder)
    [status] = registry.status()
    assert status.state == "error" and status.error is not None and culprit in status.error


async def test_load_unload_status() -> None:
    registry = ModelRegistry()
    assert registry.add("tiny", TINY_MODEL) == "generative"
    with pytest.raises(ValueError, match="already"):
        registry.add("tiny", TINY_MODEL)
    assert [(s.name, s.kind, s.state) for s in registry.status()] == [("tiny", "generative", "unloaded")]
    assert registry.loaded("tiny") is None
    loading = asyncio.create_task(registry.load("tiny"))
    await asyncio.sleep(0)
    assert registry.status()[0].state == "loading"
    model = await loading
    assert registry.loaded("tiny") is model
    assert await registry.get("tiny") is model
    assert registry.status()[0].state == "ready"
    assert [(s.name, s.path, s.state, s.error) for s in registry.status()] == [("tiny", TINY_MODEL, "ready", None)]
    await registry.unload("tiny")
    assert registry.status()[0].state == "unloaded"
    assert registry.loaded("tiny") is None
    with pytest.raises(EngineClosedError):
        model.generate("hello")
    reloaded = await registry.get("tiny")
    assert reloaded is not model
    await registry.close()


async def test_a_loaded_model_is_out_of_full_collections_until_it_is_unloaded() -> None:
    """What is alive at a load is frozen (gc.freeze): a full collection, which holds the
    GIL and so the event loop, walks only what requests made since (before, 40-74 ms every
    0.7 s under a batch of prompt-logprob answers). An unload that leaves the model alive
    (held here, as by a request still ending or a cycle) gives it back, so that a closed
    model's cycles are collected."""
    gc.unfreeze()
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    try:
        model = await registry.get("tiny")
        assert gc.get_freeze_count() > 0
        tracked = {id(o) for o in gc.get_objects()}
        assert id(model) not in tracked and id(model.__dict__) not in tracked
        await registry.unload("tiny")
        assert gc.get_freeze_count() == 0
        assert any(o is model for o in gc.get_objects())
    finally:
        await registry.close()
        gc.unfreeze()


@pytest.mark.parametrize("name", ["tiny", "whisper", "reranker", "vision"])
async def test_an_unloaded_model_frees_itself_without_a_full_collection(name: str) -> None:
    """Thirteenth probe of issue 45: the finished load's task kept the model as its result,
    so an unloaded model (session, weights, KV cache) stayed in memory until its next load
    (SmolLM2: RSS 251 MiB loaded, 251 after the unload; now 144), and the unload gave the
    whole heap back to the collector, whose next full collection held the GIL 110-200 ms.
    Now nothing holds it: reference counting frees it at the unload, with the collector
    off, and what was frozen stays frozen."""
    folders = {"tiny": TINY_MODEL, "whisper": TINY_WHISPER, "reranker": CROSS_ENCODER, "vision": TINY_PHI3V}
    gc.unfreeze()
    registry = ModelRegistry()
    registry.add(name, folders[name])
    try:
        left = weakref.ref(await registry.get(name))
        frozen = gc.get_freeze_count()
        gc.disable()
        try:
            await registry.unload(name)
            assert left() is None
            assert frozen // 2 < gc.get_freeze_count() <= frozen  # the model's own objects freed, the rest kept frozen
        finally:
            gc.enable()
    finally:
        await registry.close()
        gc.unfreeze()


async def test_concurrent_loads_share_one_model() -> None:
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    a, b = await asyncio.gather(registry.get("tiny"), registry.get("tiny"))
    assert a is b
    await registry.close()


async def test_unknown_name() -> None:
    registry = ModelRegistry()
    with pytest.raises(ModelNotFoundError) as info:
        await registry.get("nope")
    assert info.value.name == "nope" and "nope" in str(info.value)
    with pytest.raises(ModelNotFoundError):
        await registry.unload("nope")
    with pytest.raises(ModelNotFoundError):
        registry.kind("nope")
    with pytest.raises(ModelNotFoundError):
        registry.loaded("nope")


@pytest.mark.parametrize("provider", ["cuda", "dml", "qnn", "openvino", "webgpu", "trt-rtx"])
async def test_a_provider_this_build_lacks_fails_the_load_naming_it_and_the_fix(provider: str) -> None:
    """Never a silent CPU fallback: text and multimodal folders alike fail on load with the
    provider named and what to install (og reports WebGPU/QNN/OpenVINO as available, yet
    cannot load them: checked by loading)."""
    from images import TINY_PHI3V
    from ortserve_runtime import ModelConfig

    registry = ModelRegistry(ModelConfig(provider=provider))  # type: ignore[arg-type]
    registry.add("tiny", TINY_MODEL)
    registry.add("vision", TINY_PHI3V)
    for name in ("tiny", "vision"):
        with pytest.raises(ModelLoadError, match=f"on provider '{provider}'.*[Ii]nstall") as info:
            await registry.get(name)
        assert "--provider cpu" in str(info.value) or "install" in str(info.value)
        assert registry.loaded(name) is None


async def test_the_cpu_engine_refuses_another_provider() -> None:
    from ortserve_runtime import ModelConfig

    registry = ModelRegistry(ModelConfig(provider="cuda", engine="ort-cpu"))
    registry.add("tiny", TINY_MODEL)
    with pytest.raises(ModelLoadError, match="ort-cpu engine runs on the CPU provider only, not 'cuda'"):
        await registry.get("tiny")


def test_unknown_providers_and_engines_are_refused_in_the_config() -> None:
    from ortserve_runtime import ModelConfig

    with pytest.raises(ValueError, match="unknown provider 'tpu'"):
        ModelConfig(provider="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown engine 'fast'"):
        ModelConfig(engine="fast")  # type: ignore[arg-type]


def test_an_engine_for_an_embedding_or_speech_model_is_refused() -> None:
    from audio import TINY_WHISPER
    from ortserve_runtime import ModelConfig

    registry = ModelRegistry()
    with pytest.raises(
        ValueError, match="'whisper' is a speech model: the engine \\(og-engine\\) applies to generative"
    ):
        registry.add("whisper", TINY_WHISPER, ModelConfig(engine="og-engine"))


async def test_an_unload_waits_for_the_requests_holding_the_model() -> None:
    registry = ModelRegistry(unload_grace=30)
    registry.add("tiny", TINY_MODEL)
    lease = await registry.acquire("tiny")
    assert registry.status_of("tiny").in_flight == 1
    unloading = asyncio.create_task(registry.unload("tiny"))
    await asyncio.sleep(0.1)
    assert not unloading.done() and registry.status_of("tiny").state == "unloading"
    reloading = asyncio.create_task(registry.acquire("tiny"))  # waits for the unload, then loads again
    await asyncio.sleep(0.05)
    assert not reloading.done()
    lease.release()
    lease.release()  # once only
    await unloading
    again = await reloading
    assert again.model is not lease.model and registry.status_of("tiny").in_flight == 1
    again.release()
    await registry.close()


async def test_idle_timers_and_keep_alive() -> None:
    registry = ModelRegistry(idle_unload=0.1)
    registry.add("tiny", TINY_MODEL)
    lease = await registry.acquire("tiny")
    assert registry.status_of("tiny").expires_at is None  # in use: no timer
    lease.keep_alive = -1
    lease.release()
    await asyncio.sleep(0.3)
    assert registry.status_of("tiny").state == "ready" and registry.status_of("tiny").expires_at is None
    lease = await registry.acquire("tiny")
    lease.release()  # the default again: idle_unload
    assert registry.status_of("tiny").expires_at is not None
    await asyncio.sleep(0.4)
    assert registry.status_of("tiny").state == "unloaded"
    await registry.close()


async def test_least_recently_used_idle_model_makes_room_else_capacity_error() -> None:
    registry = ModelRegistry(max_loaded=2)
    for name in ("a", "b", "c"):
        registry.add(name, TINY_MODEL)
    a = await registry.acquire("a")
    b = await registry.acquire("b")
    with pytest.raises(ModelCapacityError, match="every loaded model is serving requests") as info:
        await registry.acquire("c")
    assert info.value.name == "c"
    b.release()
    a.release()  # a is now the most recently used
    c = await registry.acquire("c")
    assert [s.state for s in registry.status()] == ["ready", "unloaded", "ready"]
    c.release()
    with pytest.raises(ValueError, match="max_loaded"):
        ModelRegistry(max_loaded=0)
    await registry.close()


async def test_a_model_kept_with_a_negative_keep_alive_makes_room_last() -> None:
    registry = ModelRegistry(max_loaded=2)
    for name in ("a", "b", "c", "d"):
        registry.add(name, TINY_MODEL)
    a = await registry.acquire("a")
    a.keep_alive = -1
    a.release()  # a is the least recently used, but kept
    (await registry.acquire("b")).release()
    (await registry.acquire("c")).release()  # b goes, not a
    assert [s.state for s in registry.status()] == ["ready", "unloaded", "ready", "unloaded"]
    c = await registry.acquire("c")  # busy: only the kept model can make room now
    (await registry.acquire("d")).release()
    assert [s.state for s in registry.status()] == ["unloaded", "unloaded", "ready", "ready"]
    c.release()
    await registry.close()


async def test_a_first_load_measured_over_the_memory_budget_is_let_go_while_others_are_busy() -> None:
    # 128 MiB KV caches (zeroed pages, virtual until used) dwarf the few MiB by which a
    # resident-set delta can be off.
    registry = ModelRegistry(ModelConfig(max_batch_size=256), memory_budget=2**40)
    for name in ("a", "b"):
        registry.add(name, TINY_MODEL)
    a = await registry.acquire("a")
    cost = (a_status := registry.status_of("a")).kv_cache_bytes or 0
    assert cost > 0 and a_status.resident_bytes is not None
    registry.memory_budget = int((cost + a_status.resident_bytes) * 1.5)
    # b's first load is estimated from its folder (well under the budget), then measured.
    with pytest.raises(ModelCapacityError, match=r"needs .* \(measured\)"):
        await registry.acquire("b")
    assert [s.state for s in registry.status()] == ["ready", "unloaded"]
    with pytest.raises(ModelCapacityError, match="serving requests"):  # now estimated from the measurement
        await registry.acquire("b")
    a.release()
    (await registry.acquire("b")).release()
    assert [s.state for s in registry.status()] == ["unloaded", "ready"]
    await registry.close()


async def test_a_preload_is_taken_over_by_the_first_load(tmp_path: Path) -> None:
    """Loads started before an event loop (``ortserve serve`` overlaps them with its
    imports): the first ``load`` gets that model; a broken folder's failure is raised
    there; a preload nobody took is closed with the registry."""
    broken = tmp_path / "broken"
    shutil.copytree(TINY_MODEL, broken)
    (broken / "model.onnx").write_bytes(b"not an onnx graph")
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    registry.add("broken", broken)
    registry.add("never", TINY_MODEL)
    registry.preload(["tiny", "broken", "never"])
    untaken = registry._entries["never"].preloaded  # what close() must close
    assert untaken is not None
    try:
        model = await registry.load("tiny")
        assert await registry.load("tiny") is model
        text, _, _, _ = await model.generate("Hello", options=None).collect()
        assert isinstance(text, str)
        with pytest.raises(ModelLoadError, match=r"model\.onnx"):
            await registry.load("broken")
        assert registry.status_of("broken").state == "error"
    finally:
        await registry.close()
    assert registry.status_of("never").state == "unloaded"
    assert untaken.result()[0].engine.closing


def test_a_text_models_server_imports_no_image_or_audio_library() -> None:
    """Pillow and libsndfile load with the first image or audio (ortserve serve's start-up
    is bound by what the runtime imports before its models start loading)."""
    code = "import sys, ortserve_runtime; print(sorted({'PIL', 'soundfile'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_linked_gguf_file_keeps_its_name(tmp_path: Path) -> None:
    """The Hugging Face cache links each file to a blob named by its hash: a GGUF file (and
    a split one's parts, found beside it) is served by the link's name, not the blob's."""
    from ortserve_runtime._residency import folder_bytes

    blobs = tmp_path / "blobs"
    blobs.mkdir()
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for i, size in ((1, 100), (2, 50)):
        (blobs / f"hash{i}").write_bytes(b"x" * size)
        (snapshot / f"m-0000{i}-of-00002.gguf").symlink_to(blobs / f"hash{i}")
    registry = ModelRegistry()
    assert registry.add("m", snapshot / "m-00001-of-00002.gguf") == "generative"
    path = registry.status_of("m").path
    assert path == snapshot / "m-00001-of-00002.gguf"
    assert folder_bytes(path) == 150  # a first load is expected to cost every part's bytes
