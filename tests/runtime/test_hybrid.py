"""A hybrid decoder the ort-cpu engine cannot drive (LFM2: convolution layers with a
recurrent state beside attention layers): ``auto`` finds out at load, says why, and runs it
on og-generator with og's own greedy tokens; asked for by name, ort-cpu refuses it with
the inputs it lacks and those it does not feed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from og_reference import og_greedy
from og_reference import ordinary_ids as ids
from ortserve_runtime import GenerationOptions, ModelConfig, ModelLoadError, ModelRegistry

pytestmark = pytest.mark.anyio

LFM2 = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-lfm2"
TOKENS = 24


def without_eos(tokens: list[int]) -> list[int]:
    """og's tokens as a stream reports them: an ending EOS (``<|im_end|>``, ``<|endoftext|>``)
    ends the stream and is no token of it."""
    return tokens[:-1] if tokens and tokens[-1] in (1019, 1021) else tokens


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_auto_runs_a_hybrid_model_on_og_generator_with_ogs_tokens() -> None:
    registry = ModelRegistry()
    registry.add("lfm2", LFM2)
    try:
        model = await registry.get("lfm2")
        status = registry.status_of("lfm2")
        assert (status.state, status.engine) == ("ready", "og-generator")
        assert status.engine_reason is not None and "'past.0.conv'" in status.engine_reason
        assert "past_key_values.0.key" in status.engine_reason and "og-generator runs it" in status.engine_reason
        prompts = [ids(12, seed=1), ids(300, seed=2), ids(40, seed=3), ids(7, seed=4)]
        options = GenerationOptions(max_tokens=TOKENS, temperature=0)
        alone = [(await model.generate(p, options=options).collect())[1] for p in prompts]
        assert alone == [without_eos(og_greedy(p, TOKENS, LFM2)) for p in prompts]
        together = await asyncio.gather(*(model.generate(p, options=options).collect() for p in prompts))
        assert [result[1] for result in together] == alone
    finally:
        await registry.close()


async def test_ort_cpu_by_name_refuses_it_naming_the_inputs() -> None:
    registry = ModelRegistry(ModelConfig(engine="ort-cpu"))
    registry.add("lfm2", LFM2)
    with pytest.raises(
        ModelLoadError, match=r"lacks the inputs .*past_key_values\.0\.key.*does not feed .*past\.0\.conv"
    ):
        await registry.get("lfm2")
    status = registry.status_of("lfm2")
    assert status.state == "error" and status.error is not None and "past.0.conv" in status.error
    await registry.close()


async def test_a_text_model_on_the_cpu_says_why_it_runs_on_ort_cpu() -> None:
    from serving import TINY_MODEL

    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    try:
        await registry.get("tiny")
        assert (
            registry.status_of("tiny").engine_reason
            == "auto: a text model on the CPU runs on ort-cpu (continuous batching)"
        )
    finally:
        await registry.close()
