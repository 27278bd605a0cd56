"""LoRA adapters per request: greedy output through each adapter equals onnxruntime-genai's
own ``og.Generator`` with ``set_active_adapter``, on every engine that serves adapters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from og_reference import og_greedy, ordinary_ids
from ortserve_runtime import (
    AdapterNotFoundError,
    ChatModel,
    GenerationOptions,
    ModelConfig,
    ModelLoadError,
    ModelRegistry,
)
from serving import LORA_ADAPTERS, LORA_MODEL, TINY_MODEL

pytestmark = pytest.mark.anyio

GREEDY = GenerationOptions(max_tokens=16, temperature=0)
PROMPT = ordinary_ids(40)
"""Longer than the prefix cache's shortest reusable prefix (32 tokens), so a cached row of
one adapter would be reused by another if the cache mixed them up."""
REFERENCE = {name: og_greedy(PROMPT, 16, LORA_MODEL, adapter=path) for name, path in LORA_ADAPTERS.items()}
REFERENCE[None] = og_greedy(PROMPT, 16, LORA_MODEL)  # type: ignore[index]


@pytest.fixture(params=["ort-cpu", "og-generator"])
async def model(request: pytest.FixtureRequest) -> AsyncIterator[ChatModel]:
    registry = ModelRegistry(ModelConfig(engine=request.param, adapters=dict(LORA_ADAPTERS)))
    registry.add("lora", LORA_MODEL)
    loaded: ChatModel = await registry.get("lora")
    assert loaded.engine.name == request.param
    yield loaded
    await registry.close()


def test_each_adapter_changes_greedy_output() -> None:
    """The fixture is worth testing with: the base and both adapters all differ."""
    outputs = [tuple(tokens) for tokens in REFERENCE.values()]
    assert len(set(outputs)) == 3


async def test_greedy_through_each_adapter_equals_og(model: ChatModel) -> None:
    assert model.adapters == ("alpha", "beta")
    for adapter, reference in REFERENCE.items():
        view = model.with_adapter(adapter)
        assert view.name == ("lora" if adapter is None else f"lora:{adapter}")
        _, tokens, _, _ = await view.generate(PROMPT, options=GREEDY).collect()
        assert tokens == reference, adapter


async def test_adapters_in_concurrent_requests(model: ChatModel) -> None:
    """Requests of both adapters and the base at once (interleaved in the ort-cpu batch)
    each get what they get alone; then again, so the prefix cache holds each one's rows."""
    order = ["alpha", None, "beta", "alpha", "beta", None] * 2
    streams = [model.with_adapter(adapter).generate(PROMPT, options=GREEDY).collect() for adapter in order]
    results = await asyncio.gather(*streams)
    assert [tokens for _, tokens, _, _ in results] == [REFERENCE[adapter] for adapter in order]


async def test_ort_cpu_decodes_each_adapters_rows_in_one_call() -> None:
    """Rows arriving interleaved (a, base, b, a, base, b) are regrouped: a decode step makes
    one call per adapter in use, not one per row."""
    registry = ModelRegistry(ModelConfig(engine="ort-cpu", adapters=dict(LORA_ADAPTERS)))
    registry.add("lora", LORA_MODEL)
    model: ChatModel = await registry.get("lora")
    order = ["alpha", None, "beta"] * 2
    before = model.engine.steps  # type: ignore[attr-defined]
    streams = [model.with_adapter(adapter).generate(PROMPT, options=GREEDY).collect() for adapter in order]
    results = await asyncio.gather(*streams)
    assert [tokens for _, tokens, _, _ in results] == [REFERENCE[adapter] for adapter in order]
    calls = model.engine.steps - before  # type: ignore[attr-defined]
    # 6 prefills, then 15 steps of 3 calls (one per group); one per row would be 6 a step
    # (96 in all). A request prefilled a step after the others (a loaded machine: CI saw
    # 56) decodes one step out of step with its group: at most one more call each.
    assert calls <= 6 + 3 * 16 + 6, calls
    await registry.close()


async def test_an_unknown_adapter_is_named(model: ChatModel) -> None:
    with pytest.raises(
        AdapterNotFoundError, match=r"model 'lora' has no LoRA adapter 'gamma': its adapters are 'alpha', 'beta'"
    ):
        model.with_adapter("gamma")


async def test_og_engine_refuses_adapters_naming_the_way_out() -> None:
    registry = ModelRegistry(ModelConfig(engine="og-engine", adapters=dict(LORA_ADAPTERS)))
    registry.add("lora", LORA_MODEL)
    with pytest.raises(ModelLoadError, match=r"og-engine engine cannot serve LoRA adapters.*og-generator"):
        await registry.get("lora")


@pytest.mark.parametrize("engine", ["ort-cpu", "og-generator"])
async def test_an_adapter_that_does_not_fit_fails_the_load_naming_it(engine: str, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.onnx_adapter"
    garbage.write_bytes(b"not an adapter")
    cases = [
        (TINY_MODEL, LORA_ADAPTERS["alpha"], "was not made for"),  # a model without LoRA inputs
        (LORA_MODEL, garbage, "is not an .onnx_adapter file"),
        (LORA_MODEL, tmp_path / "missing.onnx_adapter", "does not exist"),
        (LORA_MODEL, tmp_path, "is not a regular file"),  # said "does not exist" (fourteenth probe)
    ]
    for folder, adapter, why in cases:
        registry = ModelRegistry(ModelConfig(engine=engine, adapters={"alpha": adapter}))  # type: ignore[arg-type]
        registry.add("m", folder)
        with pytest.raises(ModelLoadError, match=f"adapter 'alpha': {adapter}.* {why}"):
            await registry.get("m")


def test_adapter_names_and_kinds_are_checked() -> None:
    with pytest.raises(ValueError, match="adapter name 'a:b' must be non-empty and free of ':'"):
        ModelConfig(adapters={"a:b": LORA_ADAPTERS["alpha"]})
    registry = ModelRegistry(ModelConfig(adapters=dict(LORA_ADAPTERS)))
    with pytest.raises(ValueError, match="'whisper' is a speech model: LoRA adapters apply to generative models only"):
        registry.add("whisper", TINY_MODEL.parent / "tiny-whisper")


@pytest.mark.parametrize("engine", ["ort-cpu", "og-generator"])
async def test_adapters_load_and_unload_while_the_model_serves(engine: str) -> None:
    """Added at run time, an adapter gives what it gives loaded at startup; removed, it is
    refused while a request already running finishes through it; added again under the same
    name from the other file, the new one serves (nothing of the old one is reused)."""
    registry = ModelRegistry(ModelConfig(engine=engine))  # type: ignore[arg-type]
    registry.add("lora", LORA_MODEL)
    model: ChatModel = await registry.get("lora")
    assert model.adapters == () and registry.adapters("lora") == ()

    await registry.add_adapter("lora", "alpha", LORA_ADAPTERS["alpha"])
    assert model.adapters == ("alpha",) and registry.adapters("lora") == ("alpha",)
    _, tokens, _, _ = await model.with_adapter("alpha").generate(PROMPT, options=GREEDY).collect()
    assert tokens == REFERENCE["alpha"]
    with pytest.raises(ValueError, match="already has a LoRA adapter 'alpha'"):
        await registry.add_adapter("lora", "alpha", LORA_ADAPTERS["beta"])

    running = model.with_adapter("alpha").generate(PROMPT, options=GREEDY)
    first = await running.__anext__()  # started: holds the adapter
    await registry.remove_adapter("lora", "alpha")
    with pytest.raises(AdapterNotFoundError, match="has no LoRA adapter 'alpha'"):
        model.with_adapter("alpha")
    rest = [event async for event in running]
    streamed = [event.token_id for event in (first, *rest) if event.token_id is not None]
    assert streamed == REFERENCE["alpha"]  # finished through the adapter it started with

    await registry.add_adapter("lora", "alpha", LORA_ADAPTERS["beta"])  # the same name, the other file
    for _ in range(2):  # the second time from the prefix cache, which must not hold the old adapter's rows
        _, tokens, _, _ = await model.with_adapter("alpha").generate(PROMPT, options=GREEDY).collect()
        assert tokens == REFERENCE["beta"]
    _, tokens, _, _ = await model.generate(PROMPT, options=GREEDY).collect()
    assert tokens == REFERENCE[None]  # type: ignore[index]
    engine_state = model.engine
    if engine == "ort-cpu":  # the retired adapter's tensors and bindings are gone
        assert list(engine_state._adapter_inputs) == ["alpha@2"]  # type: ignore[attr-defined]
        assert {key[2] for key in engine_state._bindings} <= {None, "alpha@2"}  # type: ignore[attr-defined]
    assert not engine_state._retired  # type: ignore[attr-defined]  # og unloaded it too

    await registry.unload("lora")  # a later load serves what was added
    reloaded: ChatModel = await registry.get("lora")
    assert reloaded is not model and reloaded.adapters == ("alpha",)
    _, tokens, _, _ = await reloaded.with_adapter("alpha").generate(PROMPT, options=GREEDY).collect()
    assert tokens == REFERENCE["beta"]
    with pytest.raises(AdapterNotFoundError):
        await registry.remove_adapter("lora", "gamma")
    await registry.close()


async def test_adding_an_adapter_that_does_not_fit_names_the_file(tmp_path: Path) -> None:
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    await registry.get("tiny")
    with pytest.raises(ModelLoadError, match="was not made for"):
        await registry.add_adapter("tiny", "alpha", LORA_ADAPTERS["alpha"])
    with pytest.raises(ModelLoadError, match="does not exist"):
        await registry.add_adapter("tiny", "alpha", tmp_path / "missing.onnx_adapter")
    with pytest.raises(ValueError, match="free of ':'"):
        await registry.add_adapter("tiny", "a:b", LORA_ADAPTERS["alpha"])
    assert registry.adapters("tiny") == ()
    await registry.close()


def test_a_file_larger_than_the_model_is_refused_before_it_is_read(tmp_path: Path) -> None:
    from ortserve_runtime._folder import GenaiFolder
    from ortserve_runtime.engines._adapters import check_adapters

    big = tmp_path / "big.onnx_adapter"
    with big.open("wb") as sparse:
        sparse.truncate(2**31)  # 2 GiB of holes: reading it whole would take 2 GiB of memory
    with pytest.raises(ModelLoadError, match="larger than the model it would adapt"):
        check_adapters(GenaiFolder.read(LORA_MODEL), {"big": big})
