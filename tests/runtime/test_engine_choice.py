"""Choosing an engine is a check of the folder. A hybrid decoder (LFM2: convolution layers
with a recurrent state beside attention layers) and Qwen2.5-VL's text decoder (3-D MRoPE
position ids) are ones the ort-cpu engine cannot drive: ``auto`` finds out at load from
the graph, says why, and runs them on og-generator with og's own greedy tokens. The builder's fp16 CPU graph (MultiHeadAttention) is one nothing here
runs (og fails its first decode step), and so is a multimodal model's decoder served as
text (it takes ``inputs_embeds``): its load fails on every engine, saying why, rather than
loading and answering every request with a 500. Asked for by name, ort-cpu refuses either."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from og_reference import og_greedy
from og_reference import ordinary_ids as ids
from ortserve_runtime import GenerationOptions, ModelConfig, ModelLoadError, ModelRegistry
from serving import TINY_MODEL

pytestmark = pytest.mark.anyio

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LFM2 = FIXTURES / "tiny-lfm2"
FP16 = FIXTURES / "tiny-qwen2-fp16"
QWEN25VL_TEXT = FIXTURES / "tiny-qwen2.5-vl-text"
TOKENS = 24
REFUSALS = [
    pytest.param(LFM2, ["lacks the inputs ['past_key_values.0.key'", "does not feed ['past.0.conv'"], id="lfm2"),
    pytest.param(FP16, ["its attention runs as ['MultiHeadAttention'], not GroupQueryAttention"], id="fp16"),
    pytest.param(QWEN25VL_TEXT, ["its position ids have rank 3"], id="qwen2.5-vl-text"),
]
ON_OG = [REFUSALS[0], REFUSALS[2]]
"""What og-generator runs when ort-cpu cannot."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def without_eos(tokens: list[int]) -> list[int]:
    """og's tokens as a stream reports them: an ending EOS (``<|im_end|>``, ``<|endoftext|>``)
    ends the stream and is no token of it."""
    return tokens[:-1] if tokens and tokens[-1] in (1019, 1021) else tokens


@pytest.mark.parametrize(("folder", "reasons"), ON_OG)
async def test_auto_runs_it_on_og_generator_with_ogs_tokens(folder: Path, reasons: list[str]) -> None:
    registry = ModelRegistry()
    registry.add("m", folder)
    try:
        model = await registry.get("m")
        status = registry.status_of("m")
        assert (status.state, status.engine) == ("ready", "og-generator")
        assert status.engine_reason is not None and status.engine_reason.endswith("og-generator runs it")
        assert all(reason in status.engine_reason for reason in reasons), status.engine_reason
        prompts = [ids(12, seed=1), ids(300, seed=2), ids(40, seed=3), ids(7, seed=4)]
        options = GenerationOptions(max_tokens=TOKENS, temperature=0)
        alone = [(await model.generate(p, options=options).collect())[1] for p in prompts]
        assert alone == [without_eos(og_greedy(p, TOKENS, folder)) for p in prompts]
        together = await asyncio.gather(*(model.generate(p, options=options).collect() for p in prompts))
        assert [result[1] for result in together] == alone
    finally:
        await registry.close()


def exclude_embeds_folder(tmp_path: Path) -> Path:
    """A multimodal model's decoder (builder ``exclude_embeds``: it takes ``inputs_embeds``)
    served as a text model: tiny-qwen2.5-vl without its vision and embedding graphs."""
    folder = tmp_path / "exclude-embeds"
    shutil.copytree(FIXTURES / "tiny-qwen2.5-vl", folder)
    genai = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    genai["model"]["type"] = "qwen2_5_vl_text"
    for section in ("embedding", "vision"):
        del genai["model"][section]
    (folder / "genai_config.json").write_text(json.dumps(genai), encoding="utf-8")
    return folder


@pytest.mark.parametrize("engine", ["auto", "og-engine", "og-generator"])
@pytest.mark.parametrize("kind", ["fp16", "exclude-embeds"])
async def test_a_folder_no_engine_runs_fails_at_load_saying_why(kind: str, engine: str, tmp_path: Path) -> None:
    folder = FP16 if kind == "fp16" else exclude_embeds_folder(tmp_path)
    registry = ModelRegistry(ModelConfig(engine=engine))  # type: ignore[arg-type]
    registry.add("m", folder)
    with pytest.raises(ModelLoadError, match="onnxruntime-genai loads it but cannot run it on cpu") as failed:
        await registry.get("m")
    if engine == "auto":
        refusal = "not GroupQueryAttention" if kind == "fp16" else "does not feed ['inputs_embeds']"
        assert "no engine runs it" in str(failed.value) and refusal in str(failed.value)
    assert registry.status_of("m").state == "error"
    await registry.close()


@pytest.mark.parametrize(("folder", "reasons"), REFUSALS)
async def test_ort_cpu_by_name_refuses_it_saying_why(folder: Path, reasons: list[str]) -> None:
    registry = ModelRegistry(ModelConfig(engine="ort-cpu"))
    registry.add("m", folder)
    with pytest.raises(ModelLoadError, match="is not a decoder the ort-cpu engine can drive"):
        await registry.get("m")
    status = registry.status_of("m")
    assert status.state == "error" and status.error is not None
    assert all(reason in status.error for reason in reasons), status.error
    await registry.close()


async def test_a_text_model_on_the_cpu_says_why_it_runs_on_ort_cpu() -> None:
    registry = ModelRegistry()
    registry.add("tiny", TINY_MODEL)
    try:
        await registry.get("tiny")
        reason = registry.status_of("tiny").engine_reason
        assert reason == "auto: a text model on the CPU runs on ort-cpu (continuous batching)"
    finally:
        await registry.close()
